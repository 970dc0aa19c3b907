"""One KV byte budget, each arm's pool in its own KV format: the page count each format affords.

A study that compares KV formats at equal memory (``EngineConfig.kv_cache_dtype`` and
``kv_scale_granularity``) gives every arm the blocks that ``budget_bytes`` hold in that arm's
format, values plus scales (`paged.accounting.ModelSpec.blocks_for_bytes`), null page included:
an int8 or fp8 arm gets about twice the blocks of a bfloat16 one, less its scale bytes.

``priced_as`` prices an unquantized ("auto") arm as if its pages were stored in another dtype:
its pool gets the blocks the budget holds in that dtype while the engine stores and computes in
its own. It stands in for bfloat16 pages where the backend's bfloat16 step would measure
something else than the KV format (XLA on CPU runs bfloat16 attention several times slower than
float32); the arm's real pool bytes, larger than the budget, are recorded beside the priced ones.
"""

from __future__ import annotations

import dataclasses

from paged import EngineConfig, accounting
from paged.config.engine_config import DTYPES


def kv_format(cfg: EngineConfig, priced_as: str | None = None) -> str:
    """The arm's KV format as a label: ``"bfloat16"``, ``"int8:token"``, ``"fp8_e4m3:page"``."""
    if cfg.kv_cache_dtype == "auto":
        return priced_as or cfg.dtype
    return f"{cfg.kv_cache_dtype}:{cfg.kv_scale_granularity}"


def spec_of(model_config, cfg: EngineConfig, priced_as: str | None = None) -> accounting.ModelSpec:
    """The KV dimensions and format of an arm (``priced_as``: an auto arm's pricing dtype)."""
    return accounting.ModelSpec.from_model_config(
        model_config, dtype=priced_as or cfg.dtype, kv_cache_dtype=cfg.kv_cache_dtype,
        scale_granularity=cfg.kv_scale_granularity)


def check_priced_as(pairs, arms: list[tuple[str, EngineConfig]], by: str) -> dict[str, str]:
    """``{arm name: dtype}`` from ``(arm name, dtype)`` pairs, each naming an auto arm.

    Raises:
      ValueError: an unknown arm, a quantized arm, an unknown dtype or a repeated arm.
    """
    configs = dict(arms)
    out: dict[str, str] = {}
    for i, pair in enumerate(pairs):
        try:
            name, dtype = pair
        except (TypeError, ValueError):
            raise ValueError(f"{by}[{i}]={pair!r} must be an (arm name, dtype) pair") from None
        if name not in configs:
            raise ValueError(f"{by}[{i}] names arm {name!r}; arms: {sorted(configs)}")
        if configs[name].kv_cache_dtype != "auto":
            raise ValueError(f"{by}[{i}]: arm {name!r} stores {configs[name].kv_cache_dtype} "
                             "pages; only an auto arm can be priced as another dtype")
        if dtype not in DTYPES:
            raise ValueError(f"{by}[{i}]: dtype={dtype!r} must be one of {DTYPES}")
        if name in out:
            raise ValueError(f"{by}: arm {name!r} is priced twice")
        out[name] = dtype
    return out


def size_arms(arms: list[tuple[str, EngineConfig]], model_config, budget_bytes: int,
              priced_as: dict[str, str] | None = None) -> list[tuple[str, EngineConfig, dict]]:
    """Each arm with ``num_blocks`` = the blocks ``budget_bytes`` holds in its KV format.

    Args:
      arms: ``(name, EngineConfig)`` pairs whose ``num_blocks`` is unset (None).
      model_config: the model (its layers, KV heads and head dim set the bytes).
      budget_bytes: the KV pool bytes every arm gets (values, scales and the null page).
      priced_as: ``{arm name: dtype}`` (`check_priced_as`).

    Returns:
      ``(name, EngineConfig, pool)`` per arm; ``pool`` records the budget, the format, the
      blocks, the bytes per block (scales apart) and the priced pool bytes (<= the budget).

    Raises:
      ValueError: an arm that sets ``num_blocks``, or a budget whose pool cannot hold one
        request of ``max_model_len`` (`EngineConfig.pool_geometry`), naming the arm.
    """
    priced_as = priced_as or {}
    out = []
    for name, cfg in arms:
        if cfg.num_blocks is not None:
            raise ValueError(f"arm {name!r} sets num_blocks={cfg.num_blocks}; with a KV byte "
                             "budget every arm's pool is sized from the budget")
        spec = spec_of(model_config, cfg, priced_as.get(name))
        blocks = spec.blocks_for_bytes(budget_bytes, cfg.block_size)
        if blocks < 2:
            raise ValueError(f"kv_budget_bytes={budget_bytes} holds {blocks} block(s) of "
                             f"{kv_format(cfg, priced_as.get(name))} for arm {name!r}; need "
                             f"at least 2 (the null page and one block)")
        sized = dataclasses.replace(cfg, num_blocks=blocks)
        try:
            sized.pool_geometry()
        except ValueError as e:
            raise ValueError(f"arm {name!r}, kv_budget_bytes={budget_bytes}: {e}") from None
        per_block = spec.bytes_per_block(cfg.block_size)
        out.append((name, sized, {
            "kv_budget_bytes": budget_bytes, "kv_format": kv_format(cfg, priced_as.get(name)),
            "priced_as": priced_as.get(name), "num_blocks": blocks,
            "bytes_per_block": per_block,
            "scale_bytes_per_block": spec.scale_bytes_per_block(cfg.block_size),
            "priced_pool_bytes": blocks * per_block}))
    return out
