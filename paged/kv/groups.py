"""KV-cache groups: how the layers of a model with full and sliding layers share one pool.

A model whose layers are of two kinds (full attention, and a sliding window of W tokens) keeps
one block table per kind for each sequence: a *group*. Every group draws from one pool of
physical pages, so a page the sliding group recycles (it fell behind the window) can be taken
by the full group at once. For that the cache's leading axis is not "layer" but "tensor slot":
with ``G`` groups of ``L / G`` layers each, the cache is ``[L / G, Hkv, P, page, D]``, layer ``k``
of group ``g`` reads and writes slot ``k`` through group ``g``'s table, and a page (a block id)
belongs to exactly one group at a time. A block therefore holds ``L / G`` layers' worth of K/V
(vLLM's hybrid allocator shares tensors between groups the same way).

The rule here: every group has the same number of layers, ``gcd`` of the kinds' layer counts,
and each kind is split into as many groups as that takes, kinds in order of first appearance
(equal counts, e.g. alternating layers: one group per kind; 21 full + 7 sliding layers: three
full groups and one sliding group of 7; 1 full + 3 sliding: four groups of one layer). Every
group is a block table per sequence on the host, so many small groups cost host time, never
correctness.
"""

from __future__ import annotations

import dataclasses
import math


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
        """The layout of a model whose layers have these windows: every kind is split into
        groups of ``gcd`` of the kinds' layer counts (equal counts: one group per kind)."""
        kinds = tuple(dict.fromkeys(layer_windows))
        size = math.gcd(*(layer_windows.count(w) for w in kinds))
        first = {}  # kind -> its first group
        windows: list[int | None] = []
        for w in kinds:
            first[w] = len(windows)
            windows += [w] * (layer_windows.count(w) // size)
        seen = dict.fromkeys(kinds, 0)
        placement = []
        for w in layer_windows:
            j = seen[w]
            placement.append((first[w] + j // size, j % size))
            seen[w] = j + 1
        return cls(tuple(windows), tuple(placement))


def kv_group_layout(model, engine) -> KVGroupLayout | None:
    """The groups an engine serves ``model`` with: a layout when a paged engine serves a model
    with both full and sliding layers, else None (one table per sequence as before: full
    attention everywhere, or every layer sliding, or the contiguous layout).

    Args:
      model: the model's ``LlamaConfig``.
      engine: the ``EngineConfig``.

    The settings the grouped pool does not serve yet (a draft model, the host tier,
    disaggregated replicas, several processes) are refused by `paged.config.support`.
    """
    windows = model.layer_windows
    if engine.kv_layout != "paged" or None not in windows or len(set(windows)) == 1:
        return None
    return KVGroupLayout.of(windows)
