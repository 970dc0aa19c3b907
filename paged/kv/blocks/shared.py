"""`SharedParts`: the parts every KV-cache group of one pool shares (one `BlockManager` per group,
`paged.kv.group_manager`): the prefix index, the block pool and the step fence."""

from __future__ import annotations

from typing import NamedTuple

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
              on_free) -> SharedParts:
        index = PrefixCacheIndex(num_blocks)
        pool = BlockPool(num_blocks, index, on_free)
        return cls(index, pool, StepFence(pool, quarantine_steps, num_host_blocks))


