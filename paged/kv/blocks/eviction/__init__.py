"""Prefix-cache eviction policies: one file each, one interface (`base`'s module docstring),
chosen once at construction from the ``prefix_eviction`` setting (`paged.config.eviction`)."""

from __future__ import annotations

from paged.config.eviction import parse_eviction
from paged.kv.blocks.eviction.arc import ARCOrder
from paged.kv.blocks.eviction.cost import CostOrder
from paged.kv.blocks.eviction.lfu import LFUOrder
from paged.kv.blocks.eviction.lru import LRUOrder
from paged.kv.blocks.eviction.priority import PriorityOrder
from paged.kv.blocks.eviction.slru import SLRUOrder
from paged.kv.blocks.eviction.tail_first import TailFirstOrder
from paged.kv.blocks.eviction.waiting import WaitingAwareOrder


def make_order(spec: str, num_blocks: int, index, block_size: int):
    """A fresh eviction order for ``num_blocks`` blocks (or slots) keyed in ``index``.

    Raises:
      ValueError / TypeError: a bad ``spec`` (`paged.config.eviction.parse_eviction`).
    """
    name, p = parse_eviction(spec)
    if name == "lru":
        return LRUOrder()
    if name == "lfu":
        return LFUOrder(num_blocks)
    if name == "slru":
        return SLRUOrder(num_blocks, p["protected"])
    if name == "priority":
        return PriorityOrder(num_blocks, p["default"])
    if name == "cost":
        return CostOrder(num_blocks, index, block_size, p["alpha"])
    if name == "arc":
        return ARCOrder(num_blocks)
    if name == "waiting":
        return WaitingAwareOrder(p["lookahead"])
    return TailFirstOrder(index)


__all__ = ["ARCOrder", "CostOrder", "LFUOrder", "LRUOrder", "PriorityOrder", "SLRUOrder", "TailFirstOrder",
           "WaitingAwareOrder", "make_order"]
