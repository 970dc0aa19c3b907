"""`EvictionOrder`: the one interface of a prefix-cache eviction policy, and `HeapOrder`, the
base of the policies that rank blocks by a score.

An order holds the evictable entries (the pool's cached refcount-0 blocks, or the host tier's
cached slots), each with its key digest, as a mapping: ``order[b] = digest`` when ``b`` becomes
evictable, ``del order[b]`` when it stops being evictable (a hit revives it, a load holds it),
``b in order``, ``order[b]`` (its digest), ``len(order)``, iteration in victim order;
``evict_one()`` removes and returns the victim ``(b, digest)``; ``touch(b)`` records a use of an
entry that stays evictable. ``on_take(blocks)`` (fresh content) and ``on_hit(b)`` (a prefix hit,
any refcount) feed per-block statistics; ``None`` where a policy keeps none. The owner (pool or
tier) decides *when* an entry enters or leaves; the order only decides *which* goes first, so the
rules of the cache (full-key check, quarantine, salts, content versions) hold under every policy.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterator


class HeapOrder:
    """Entries ranked by ``score(b)`` (a tuple fixed when ``b`` enters; lowest evicted first),
    ties by entry order (older first). A lazy min-heap: entries that left stay in the heap until
    they reach the top or the heap is rebuilt."""

    name = "heap"
    on_take = None
    on_hit = None

    def __init__(self, num_blocks: int):
        self.members: dict[int, Hashable] = {}
        self.heap: list[tuple] = []
        self.stamp = [0] * num_blocks  # the tick of each member's live heap entry
        self.rank: dict[int, tuple] = {}  # member -> its live heap entry
        self.tick = 0

    def score(self, b: int) -> tuple:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.members)

    def __bool__(self) -> bool:
        return bool(self.members)

    def __contains__(self, b) -> bool:
        return b in self.members

    def __getitem__(self, b) -> Hashable:
        return self.members[b]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.members, key=self.rank.__getitem__))

    def __setitem__(self, b: int, digest: Hashable) -> None:
        self.members[b] = digest
        self._push(b, self.score(b))

    def _push(self, b: int, score: tuple, tick: int | None = None) -> None:
        if tick is None:
            self.tick += 1
            tick = self.tick
        entry = (*score, tick, b)
        self.stamp[b] = tick
        self.rank[b] = entry
        heapq.heappush(self.heap, entry)
        if len(self.heap) > 2 * len(self.members) + 64:
            self.heap = [self.rank[m] for m in self.members]
            heapq.heapify(self.heap)

    def __delitem__(self, b: int) -> None:
        del self.members[b]
        del self.rank[b]

    def evict_one(self) -> tuple[int, Hashable]:
        heap, rank = self.heap, self.rank
        while True:
            entry = heapq.heappop(heap)
            b = entry[-1]
            if rank.get(b) is entry:  # else it left, or re-entered with a newer entry
                del rank[b]
                return b, self.members.pop(b)

    def touch(self, b: int) -> None:
        if self.on_hit is not None:
            self.on_hit(b)
        self[b] = self.members[b]


class TwoSegmentOrder:
    """The mapping part of an order kept in two LRU segments (``OrderedDict`` of block -> digest,
    the first one's entries evicted before the second's), with each block's hits since it got
    its content (``hits``, fed by ``on_take`` / ``on_hit``): SLRU and ARC."""

    def __init__(self, num_blocks: int):
        self.first: OrderedDict[int, Hashable] = OrderedDict()
        self.second: OrderedDict[int, Hashable] = OrderedDict()
        self.hits = [0] * num_blocks

    def on_take(self, blocks) -> None:
        hits = self.hits
        for b in blocks:
            hits[b] = 0

    def on_hit(self, b: int) -> None:
        self.hits[b] += 1

    def __len__(self) -> int:
        return len(self.first) + len(self.second)

    def __bool__(self) -> bool:
        return bool(self.first or self.second)

    def __contains__(self, b) -> bool:
        return b in self.first or b in self.second

    def __getitem__(self, b) -> Hashable:
        return self.first[b] if b in self.first else self.second[b]
