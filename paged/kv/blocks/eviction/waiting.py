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

    def evict_one(self):
        protected = self.protected
        if protected:
            for b in self:
                if b not in protected:
                    return b, self.pop(b)
        return self.popitem(last=False)
