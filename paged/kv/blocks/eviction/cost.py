"""Cost-aware: frequency x recompute cost, the form of vllm#23641: evict the block whose
``uses * (prefix tokens) ** alpha`` is smallest, where ``prefix tokens`` is the length of the
prefix the block ends (recomputing a deeper block costs more attention) and ``uses`` counts its
computation and its prefix hits since it got its content. The issue divides ``uses`` by the
time since the first use (a rate); a rate changes every block's score as time passes, which no
heap key can follow, so this uses the count (equal for blocks of the same age). Ties: LRU."""

from __future__ import annotations

from paged.kv.blocks.eviction.lfu import LFUOrder


class CostOrder(LFUOrder):  # LFU's use counts, weighted by the prefix's recompute cost
    name = "cost"

    def __init__(self, num_blocks: int, index, block_size: int, alpha: float):
        super().__init__(num_blocks)
        self.index, self.block_size, self.alpha = index, block_size, alpha

    def score(self, b: int) -> tuple:
        depth, key = 0, self.index.key[b]
        while key is not None:
            depth += 1
            key = key.parent
        return (self.uses[b] * float(depth * self.block_size) ** self.alpha,)
