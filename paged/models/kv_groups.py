"""KV-cache groups: how the layers of a model with full and sliding layers share one pool.

A model whose layers are of two kinds (full attention, and a sliding window of W tokens) keeps
one block table per kind for each sequence: a *group*. Every group draws from one pool of
physical pages, so a page the sliding group recycles (it fell behind the window) can be taken
by the full group at once. For that the cache's leading axis is not "layer" but "tensor slot":
with ``G`` groups of ``L / G`` layers each, the cache is ``[L / G, Hkv, P, page, D]``, layer ``k``
of group ``g`` reads and writes slot ``k`` through group ``g``'s table, and a page (a block id)
belongs to exactly one group at a time. A block therefore holds ``L / G`` layers' worth of K/V
(vLLM's hybrid allocator shares tensors between groups the same way).

The rule here: groups are the distinct windows in order of first appearance; every group must
have the same number of layers (Qwen2's ``max_window_layers`` split and Gemma-style alternation
both do when the counts match). Other splits (e.g. 1 full layer and 3 sliding) are refused with
a ValueError: vLLM would split the bigger kind into several groups of the common size, which is
not built here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KVGroupLayout:
    """Which group and tensor slot each layer uses.

    Attributes:
      windows: each group's sliding window (None: full attention), in group order.
      placement: per layer, ``(group, slot)``.
    """

    windows: tuple[int | None, ...]
    placement: tuple[tuple[int, int], ...]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """Tensor slots of the cache's leading axis: layers per group."""
        return len(self.placement) // len(self.windows)

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...]) -> KVGroupLayout:
        """The layout of a model whose layers have these windows.

        Raises:
          ValueError: the kinds have different numbers of layers.
        """
        windows = tuple(dict.fromkeys(layer_windows))
        counts = [layer_windows.count(w) for w in windows]
        if len(set(counts)) != 1:
            kinds = ", ".join(f"{n} x {'full' if w is None else f'window {w}'}"
                              for w, n in zip(windows, counts))
            raise ValueError(f"KV-cache groups need the same number of layers of each kind; "
                             f"this model has {kinds} (layer windows {layer_windows})")
        seen = dict.fromkeys(windows, 0)
        placement = []
        for w in layer_windows:
            placement.append((windows.index(w), seen[w]))
            seen[w] += 1
        return cls(windows, tuple(placement))


def kv_group_layout(model, engine) -> KVGroupLayout | None:
    """The groups an engine serves ``model`` with: a layout when a paged engine serves a model
    with both full and sliding layers, else None (one table per sequence as before: full
    attention everywhere, or every layer sliding, or the contiguous layout).

    Args:
      model: the model's ``LlamaConfig``.
      engine: the ``EngineConfig``.

    Raises:
      ValueError: uneven layer kinds, or a setting the grouped pool does not serve yet (a
        draft model, the host tier, disaggregated replicas).
    """
    windows = model.layer_windows
    if engine.kv_layout != "paged" or None not in windows or len(set(windows)) == 1:
        return None
    layout = KVGroupLayout.of(windows)
    spec = engine.speculative
    refused = {
        "speculative method='draft'": spec is not None and spec.method == "draft",
        "host_kv_cache_bytes > 0": engine.host_kv_cache_bytes > 0,
        "prefill_replicas > 0": engine.prefill_replicas > 0,
    }
    for name, on in refused.items():
        if on:
            raise ValueError(f"{name} is not supported yet for a model with full and sliding "
                             f"layers (KV-cache groups, windows {layout.windows}); use "
                             "kv_layout='contiguous' or turn it off")
    return layout
