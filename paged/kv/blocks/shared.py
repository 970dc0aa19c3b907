"""`SharedParts`: the parts every KV-cache group of one pool shares (one `BlockManager` per group,
`paged.kv.group_manager`): the prefix index, the block pool and the step fence."""

from __future__ import annotations

from typing import NamedTuple

from paged.kv.blocks.eviction import make_order
from paged.kv.blocks.fence import StepFence
from paged.kv.blocks.pool import BlockPool
from paged.kv.blocks.prefix_index import PrefixCacheIndex


class SharedParts(NamedTuple):
    """The parts every KV-cache group of one pool shares: prefix index, block pool, step fence."""

    index: PrefixCacheIndex
    pool: BlockPool
    fence: StepFence

    @classmethod
    def build(cls, num_blocks: int, quarantine_steps: int, num_host_blocks: int,
              on_free, *, eviction: str = "lru", block_size: int = 1) -> SharedParts:
        """``eviction``: the pool's eviction order (`paged.kv.blocks.eviction`); ``block_size``
        is what a cost-aware order prices a block's prefix by."""
        index = PrefixCacheIndex(num_blocks)
        order = None if eviction == "lru" else make_order(eviction, num_blocks, index, block_size)
        pool = BlockPool(num_blocks, index, on_free, order)
        return cls(index, pool, StepFence(pool, quarantine_steps, num_host_blocks))


