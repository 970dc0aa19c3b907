"""LFU: the block with the fewest uses since it got its content goes first (its computation
counts as one use, each prefix hit adds one); least recently released first among equals."""

from __future__ import annotations

from paged.kv.blocks.eviction.base import HeapOrder


class LFUOrder(HeapOrder):
    name = "lfu"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.uses = [0] * num_blocks

    def on_take(self, blocks) -> None:
        uses = self.uses
        for b in blocks:
            uses[b] = 1

    def on_hit(self, b: int) -> None:
        self.uses[b] += 1

    def score(self, b: int) -> tuple:
        return (self.uses[b],)
