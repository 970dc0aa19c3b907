"""Priority with retention (TensorRT-LLM's ``KvCacheRetentionConfig`` in its simplest form): each
block carries the priority (0..100, higher stays longer) of the last request that released it,
which keeps it until ``retain``'s ``until`` time passes (None: for good); then, and for blocks
no request gave a priority, it competes at ``default``. Lowest priority first, least recently
released first among equals. Time is what ``advance(now)`` last said (the scheduler's clock)."""

from __future__ import annotations

import heapq

from paged.kv.blocks.eviction.base import HeapOrder


class PriorityOrder(HeapOrder):
    name = "priority"

    def __init__(self, num_blocks: int, default: int):
        super().__init__(num_blocks)
        self.default = default
        self.priority = [default] * num_blocks
        self.until: list[float | None] = [None] * num_blocks
        self.expiring: list[tuple[float, int, int]] = []  # (until, tick, block) of members
        self.now = 0.0

    def on_take(self, blocks) -> None:
        for b in blocks:
            self.priority[b] = self.default
            self.until[b] = None

    def retain(self, blocks, priority: int, until: float | None) -> None:
        """``blocks`` keep ``priority`` until time ``until`` (None: for good); called while they
        are in use, before they are released."""
        for b in blocks:
            self.priority[b] = priority
            self.until[b] = until

    def advance(self, now: float) -> None:
        """The clock moved to ``now``: blocks whose retention ended drop to the default."""
        self.now = max(self.now, now)
        exp, stamp, members = self.expiring, self.stamp, self.members
        while exp and exp[0][0] <= self.now:
            _, tick, b = heapq.heappop(exp)
            if b in members and stamp[b] == tick:
                self._push(b, (self.default,), tick)  # same release order, default priority

    def _effective(self, b: int) -> int:
        until = self.until[b]
        return self.priority[b] if until is None or until > self.now else self.default

    def score(self, b: int) -> tuple:
        return (self._effective(b),)

    def __setitem__(self, b: int, digest) -> None:
        super().__setitem__(b, digest)
        if self.until[b] is not None and self._effective(b) != self.default:
            heapq.heappush(self.expiring, (self.until[b], self.stamp[b], b))

    def evict_one(self):
        self.advance(self.now)
        return super().evict_one()
