"""ARC (Megiddo & Modha, FAST 2003) over the evictable blocks: a recency list ``t1`` (blocks
released with no hit since they got their content) and a frequency list ``t2`` (hit at least
once, or recomputed while their digest was remembered), each least recent first, plus two
ghost lists of the digests they evicted (``b1``, ``b2``, at most the pool's size each). A
recomputed block whose digest is in ``b1`` says ``t1`` was too small: the target size ``p`` of
``t1`` grows; one in ``b2`` shrinks it. Victims come from ``t1`` while it is above ``p``, else
from ``t2``. Unlike LFU and SLRU, history survives eviction (the ghosts), so a block that comes
back after being evicted is known as a re-use. A ghost is seen when the block is released (its
digest is known then), one request later than ARC's textbook miss."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from paged.kv.blocks.eviction.base import TwoSegmentOrder


class ARCOrder(TwoSegmentOrder):
    name = "arc"

    def __init__(self, num_blocks: int):
        self.c = num_blocks
        self.p = 0.0  # target number of t1 entries
        super().__init__(num_blocks)
        self.t1, self.t2 = self.first, self.second  # the segments' names here
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def __iter__(self) -> Iterator[int]:  # victim order if p does not move
        over = max(0, len(self.t1) - int(self.p))
        t1 = list(self.t1)
        yield from t1[:over]
        yield from self.t2
        yield from t1[over:]

    def __setitem__(self, b: int, digest: Hashable) -> None:
        b1, b2 = self.b1, self.b2
        if digest in b1:  # evicted from t1, needed again: t1 deserved more room
            self.p = min(float(self.c), self.p + max(len(b2) / len(b1), 1.0))
            del b1[digest]
            self.t2[b] = digest
        elif digest in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[digest]
            self.t2[b] = digest
        elif self.hits[b]:
            self.t2[b] = digest
        else:
            self.t1[b] = digest

    def __delitem__(self, b: int) -> None:
        if b in self.t1:
            del self.t1[b]
        else:
            del self.t2[b]

    def evict_one(self):
        if self.t1 and (len(self.t1) > self.p or not self.t2):
            b, d = self.t1.popitem(last=False)
            ghosts = self.b1
        else:
            b, d = self.t2.popitem(last=False)
            ghosts = self.b2
        ghosts[d] = None
        if len(ghosts) > self.c:
            ghosts.popitem(last=False)
        return b, d

    def touch(self, b: int) -> None:
        digest = self[b]
        del self[b]
        self.on_hit(b)
        self[b] = digest
