"""SLRU (segmented LRU, two segments): a block released without a hit since it got its content
waits in the probation segment; one hit at least once goes to the protected segment, which
holds at most ``protected`` x pool blocks (its least recent entry drops back to probation's most
recent end when it overflows). Victims come from probation first, least recent first."""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from paged.kv.blocks.eviction.base import TwoSegmentOrder


class SLRUOrder(TwoSegmentOrder):
    name = "slru"

    def __init__(self, num_blocks: int, protected: float):
        self.cap = int(protected * num_blocks)
        super().__init__(num_blocks)
        self.probation, self.protected = self.first, self.second  # the segments' names here

    def __iter__(self) -> Iterator[int]:
        yield from self.probation
        yield from self.protected

    def __setitem__(self, b: int, digest: Hashable) -> None:
        if not self.hits[b]:
            self.probation[b] = digest
            return
        self.protected[b] = digest
        while len(self.protected) > self.cap:
            old, d = self.protected.popitem(last=False)
            self.probation[old] = d

    def __delitem__(self, b: int) -> None:
        if b in self.probation:
            del self.probation[b]
        else:
            del self.protected[b]

    def evict_one(self):
        return (self.probation or self.protected).popitem(last=False)

    def touch(self, b: int) -> None:
        digest = self[b]
        del self[b]
        self.on_hit(b)
        self[b] = digest
