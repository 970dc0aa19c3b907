"""The engine a server command line describes (``--model random-small``: random weights);
used by `paged.server.cli` in process and by `paged.server.core_process` in a child."""

from __future__ import annotations

from paged.config import EngineConfig


def random_small():
    """``(config, params)`` of the small random-weight model that ``--model random-small`` names
    (the same shapes as the studies' ``random-small``)."""
    from paged.models.config import LlamaConfig
    from paged.models.registry import init_params

    cfg = LlamaConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      ffn_dim=128)
    return cfg, init_params(cfg, 0)


def make_engine(config: EngineConfig, *, warmup: bool = False):
    """The engine ``config`` describes (``random-small``: random weights), optionally warmed up."""
    from paged import Engine

    kwargs = {}
    if config.model == "random-small":
        kwargs["model_config"], kwargs["params"] = random_small()
    engine = Engine(config, **kwargs)
    if warmup:
        engine.warmup()
    return engine
