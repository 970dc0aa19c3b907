"""A replica's host block manager and the pool geometry it manages, from the engine settings.

One place decides what the host side of a KV pool looks like: how many pages (page 0 is the null
page), how many block-table entries a sequence row holds, how many host swap slots there are,
and which block manager serves them: a `paged.kv.block_manager.BlockManager`, or, for a model with
full and sliding layers served with one table per kind (`paged.kv.groups`), a
`paged.kv.group_manager.GroupedBlockManager` over the same bytes in ``G`` times as many pages of
``L / G`` layers each.
"""

from __future__ import annotations

from typing import NamedTuple

from paged.config.engine_config import EngineConfig
from paged.kv.block_manager import BlockManager
from paged.kv.group_manager import GroupedBlockManager
from paged.kv.groups import KVGroupLayout


class HostPool(NamedTuple):
    """What `build_host_pool` returns.

    Attributes:
      block_manager: the replica's block manager.
      page_size: tokens per page.
      num_pages: pages of the device pool, the null page included.
      pages_per_seq: block-table entries per sequence row (``G`` per block of tokens when grouped).
      host_blocks: host swap slots (``preemption_mode="swap"``; else 0).
    """

    block_manager: BlockManager | GroupedBlockManager
    page_size: int
    num_pages: int
    pages_per_seq: int
    host_blocks: int


def build_host_pool(config: EngineConfig, *, model_salt: str, on_free=None,
                    sliding_window: int | None = None, host_tier_blocks: int = 0,
                    kv_groups: KVGroupLayout | None = None) -> HostPool:
    """The block manager and geometry of one replica's pool (``HostCore``'s arguments)."""
    page_size, num_pages = config.pool_geometry()
    host_blocks = 0
    if config.preemption_mode == "swap":
        host_blocks = num_pages if config.num_host_blocks is None else config.num_host_blocks
    pages_per_seq = -(-config.max_model_len // page_size)
    caching = config.enable_prefix_caching and config.kv_layout == "paged"
    if kv_groups is None:
        bm = BlockManager(
            num_pages, page_size, enable_prefix_caching=caching,
            cache_salt=model_salt, quarantine_steps=config.quarantine_steps,
            num_host_blocks=host_blocks, debug=config.debug_checks, on_free=on_free,
            sliding_window=sliding_window if config.kv_layout == "paged" else None,
            num_host_tier_blocks=host_tier_blocks)
        return HostPool(bm, page_size, num_pages, pages_per_seq, host_blocks)
    # One table per group, interleaved in a row; pages of L / G layers each.
    G = kv_groups.num_groups
    num_pages = G * (num_pages - 1) + 1
    if host_blocks:  # slots of one page each: G per block of the full-layer pool
        host_blocks = num_pages if config.num_host_blocks is None else G * config.num_host_blocks
    bm = GroupedBlockManager(
        num_pages, page_size, kv_groups.windows, enable_prefix_caching=caching,
        cache_salt=model_salt, quarantine_steps=config.quarantine_steps,
        num_host_blocks=host_blocks, debug=config.debug_checks, on_free=on_free)
    return HostPool(bm, page_size, num_pages, G * pages_per_seq, host_blocks)
