"""The KV spec: what a replica's KV cache is, decided once from (model, ``EngineConfig``).

``KVSpec.build(model, config)`` answers, in one place, every question the pool, the device cache,
the accounting and the simulator ask about a served model's KV (vLLM's ``kv_cache_interface``
idea: a mechanism is part of the spec, chosen at construction):

* its KV-cache groups and their windows: one group (full attention, or one sliding window W
  recycled behind the window: a uniform window is a one-group spec), or, for a paged model with
  full and sliding layers, one group per ``paged.kv.groups.KVGroupLayout`` group;
* its page format: the pool's ``paged.accounting.ModelSpec`` (layers per page, heads, head
  dimension, dtype, KV storage dtype and scale granularity) and bytes per block;
* the salt of every prefix-cache key (model, weights, dtype, page format), so the engine and the
  simulator key blocks alike;
* the host-tier slots ``host_kv_cache_bytes`` affords.

Host-only: imports no JAX (models hand their dimensions in duck-typed).
"""

from __future__ import annotations

import dataclasses

from paged.accounting.formulas import ModelSpec
from paged.kv.groups import KVGroupLayout, kv_group_layout


def recycling_window(model, engine) -> int | None:
    """The window whose blocks an engine may recycle: W when every layer slides, else None (a
    model with full layers keeps every block; its sliding layers are only masked). Which
    mechanisms may be combined with windows is `paged.config.support`'s table.

    Args:
      model: with ``layer_windows`` (each layer's window, None: full) and ``sliding_window``.
      engine: the `EngineConfig` (its ``block_size`` and ``kv_layout``).

    Raises:
      ValueError: a paged engine whose ``block_size`` is longer than the window.
    """
    windows = {w for w in model.layer_windows if w is not None}
    if windows and engine.kv_layout == "paged" and min(windows) < engine.block_size:
        raise ValueError(f"sliding_window={min(windows)} is shorter than a page "
                         f"(block_size={engine.block_size}): serve it with block_size <= "
                         f"{min(windows)}")
    if None in model.layer_windows:
        return None
    return model.sliding_window


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """One replica's KV cache, as the pool, the cache, the accounting and the simulator see it.

    Attributes:
      block_size: tokens per page.
      window: W when every layer slides (recycled behind the window in a paged pool; a
        simulated step counts only in-window reads under any layout), else None.
      group_windows: the window each KV-cache group's block table recycles (None: keeps every
        block), in group order: one entry unless ``layout`` (the block manager's one entry
        point for windows).
      layout: which group and tensor slot each layer uses (a paged model with full and sliding
        layers), else None.
      model: the whole model's KV format (``accounting.ModelSpec``: every layer), or None for a
        model that states no KV dimensions (the simulator's default byte model).
      salt: what identifies the model, its weights and its page format in every prefix-cache
        key.
      host_tier_blocks: host-tier slots ``host_kv_cache_bytes`` affords (0: no tier).
    """

    block_size: int
    window: int | None
    group_windows: tuple[int | None, ...]
    layout: KVGroupLayout | None
    model: ModelSpec | None
    salt: str
    host_tier_blocks: int = 0

    @classmethod
    def build(cls, model, config) -> KVSpec:
        """The spec of ``config`` (an ``EngineConfig``) serving ``model`` (a ``LlamaConfig``, a
        ``paged.sim.ModelDims``, or anything with ``layer_windows``, ``sliding_window``,
        ``vocab_size`` and ``to_dict()``). A model with ``model_spec()`` (``ModelDims``) states
        its own KV storage; any other model's KV is stored in ``config.dtype`` /
        ``kv_cache_dtype`` / ``kv_scale_granularity``.

        Raises:
          ValueError: a window the pool cannot serve (``recycling_window``), a host-tier budget
            above 0 smaller than one block, or a setting KV-cache groups do not serve yet
            (``paged.kv.groups.kv_group_layout``).
          TypeError: a host tier for a model without KV dimensions.
        """
        window = recycling_window(model, config)
        if hasattr(model, "model_spec"):
            fmt = model.model_spec()
        elif all(hasattr(model, n) for n in ("num_layers", "num_kv_heads", "head_dim")):
            fmt = ModelSpec.from_model_config(
                model, dtype=config.dtype, kv_cache_dtype=config.kv_cache_dtype,
                scale_granularity=config.kv_scale_granularity,
                page_bounds=getattr(config, "sparse_decode", None) is not None)
        else:
            fmt = None
        salt = (f"{config.model}|{model.to_dict()}|{config.dtype}"
                f"|{config.kv_cache_dtype}|{config.kv_scale_granularity}")
        tier = _tier_blocks(config, fmt, model)
        layout = kv_group_layout(model, config)
        if layout is not None:
            windows = layout.windows
        else:
            windows = (window if config.kv_layout == "paged" else None,)
        return cls(config.block_size, window, windows, layout, fmt, salt, tier)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_slots(self) -> int:
        """Layers one page holds (the device cache's leading axis): every layer, or one group's
        share ``L / G``."""
        if self.layout is not None:
            return self.layout.num_slots
        return self.model.num_layers

    @property
    def page(self) -> ModelSpec:
        """The format of one pool page: ``model`` with ``num_slots`` layers."""
        return dataclasses.replace(self.model, num_layers=self.num_slots)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of ``block_size`` tokens over every layer, scales included (what a
        host-tier slot or a hand-over moves per block)."""
        return self.model.bytes_per_block(self.block_size)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one pool page (every layer, or one group's layers), scales included."""
        return self.page.bytes_per_block(self.block_size)


def _tier_blocks(config, fmt: ModelSpec | None, model) -> int:
    if not config.host_kv_cache_bytes:
        return 0
    if fmt is None:
        raise TypeError(f"host_kv_cache_bytes={config.host_kv_cache_bytes} needs a "
                        f"model_config with KV dimensions (a paged.sim.ModelDims), got "
                        f"{type(model).__name__}")
    per_block = fmt.bytes_per_block(config.block_size)
    n = config.host_kv_cache_bytes // per_block
    if n < 1:
        raise ValueError(f"host_kv_cache_bytes={config.host_kv_cache_bytes} holds no block of "
                         f"{per_block} bytes (block_size={config.block_size})")
    return n


__all__ = ["KVSpec", "recycling_window"]
