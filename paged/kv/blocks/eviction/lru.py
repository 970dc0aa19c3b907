"""LRU: the default order (least recently released first), exactly the pool's order before
eviction became a strategy. An ``OrderedDict`` of cached block -> key digest: the mapping
protocol of every eviction order (``order[b] = digest`` enters, ``del order[b]`` leaves,
iteration is victim order) at C speed, plus ``evict_one`` and ``touch``."""

from __future__ import annotations

from collections import OrderedDict


class LRUOrder(OrderedDict):
    """Cached blocks (or host slots) -> key digest, least recently released first."""

    name = "lru"
    on_take = None  # no per-block statistics: the pool skips the calls
    on_hit = None

    def evict_one(self):
        """``(block, digest)`` of the victim, removed."""
        return self.popitem(last=False)

    def touch(self, b: int) -> None:
        """A cached entry was used again without leaving the order (the host tier's dedup)."""
        self.move_to_end(b)
