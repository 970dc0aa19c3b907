"""Waiting-queue-aware LRU (vllm#48485): LRU, except that blocks the first ``lookahead`` waiting
requests would hit are evicted only when nothing else is left. The block manager's
``protect_waiting`` sets the protected blocks (from the scheduler's waiting queue, each step);
eviction skips them in LRU order, so a protected block costs one skip per eviction."""

from __future__ import annotations

from paged.kv.blocks.eviction.lru import LRUOrder


class WaitingAwareOrder(LRUOrder):
    name = "waiting"

    def __init__(self, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.protected: set[int] = set()

    def protect(self, blocks) -> None:
        """Replaces the protected set."""
        self.protected = set(blocks)

    def __iter__(self):
        """Victim order: unprotected blocks (LRU), then protected ones (LRU)."""
        protected = self.protected
        if not protected:
            yield from self.keys()
            return
        yield from (b for b in self.keys() if b not in protected)
        yield from (b for b in self.keys() if b in protected)

    def evict_one(self):
        if not self.protected:
            return self.popitem(last=False)
        b = next(iter(self))
        return b, self.pop(b)
