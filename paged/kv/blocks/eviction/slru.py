"""SLRU (segmented LRU, two segments): a block released without a hit since it got its content
waits in the probation segment; one hit at least once goes to the protected segment, which
holds at most ``protected`` x pool blocks (its least recent entry drops back to probation's most
recent end when it overflows). Victims come from probation first, least recent first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator


class SLRUOrder:
    name = "slru"

    def __init__(self, num_blocks: int, protected: float):
        self.cap = int(protected * num_blocks)
        self.probation: OrderedDict[int, Hashable] = OrderedDict()
        self.protected: OrderedDict[int, Hashable] = OrderedDict()
        self.hits = [0] * num_blocks

    def on_take(self, blocks) -> None:
        hits = self.hits
        for b in blocks:
            hits[b] = 0

    def on_hit(self, b: int) -> None:
        self.hits[b] += 1

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __bool__(self) -> bool:
        return bool(self.probation or self.protected)

    def __contains__(self, b) -> bool:
        return b in self.probation or b in self.protected

    def __getitem__(self, b) -> Hashable:
        return self.probation[b] if b in self.probation else self.protected[b]

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
