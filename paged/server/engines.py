"""The engine a server command line describes (``--model random-small``: random weights);
used by `paged.server.cli` in process and by `paged.server.core_process` in a child."""

from __future__ import annotations

from paged.config.engine_config import EngineConfig


def random_small():
    """``(config, params)`` of the small random-weight model that ``--model random-small`` names
    (the same shapes as the studies' ``random-small``)."""
    from paged.models.config import LlamaConfig
    from paged.models.registry import init_params

    cfg = LlamaConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      ffn_dim=128)
    return cfg, init_params(cfg, 0)


def make_engine(config: EngineConfig, *, warmup: bool = False,
                replica: tuple[int, int] | None = None):
    """The engine ``config`` describes (``random-small``: random weights), optionally warmed up.

    ``replica=(i, D)``: only replica ``i`` of ``D = config.data_parallel_size``, a one-replica
    engine on the devices the in-process data-parallel engine would give replica ``i``."""
    import dataclasses

    from paged import Engine

    kwargs = {}
    if config.model == "random-small":
        kwargs["model_config"], kwargs["params"] = random_small()
    if replica is not None:
        import jax

        from paged.engine.placement import split_devices

        i, d = replica
        config = dataclasses.replace(config, data_parallel_size=1)
        if "model_config" not in kwargs:
            from paged.models.registry import load_any

            kwargs["model_config"], kwargs["params"], _ = load_any(
                config.model, dtype=config.dtype, max_model_len=config.max_model_len)
        kwargs["devices"] = split_devices(jax.devices(), d, config.tensor_parallel_size,
                                          kwargs["model_config"].num_kv_heads)[i]
    engine = Engine(config, **kwargs)
    if warmup:
        engine.warmup()
    return engine
