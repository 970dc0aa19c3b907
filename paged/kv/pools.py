"""A replica's host block manager and the pool geometry it manages, from the engine settings.

One place decides what the host side of a KV pool looks like: how many pages (page 0 is the null
page), how many block-table entries a sequence row holds, how many host swap slots there are,
and which block manager serves the `paged.kv.spec.KVSpec`'s groups: a
`paged.kv.block_manager.BlockManager` for a one-group spec (its window, if any, recycled), or a
`paged.kv.group_manager.GroupedBlockManager` for several groups (a model with full and sliding
layers) over the same bytes in ``G`` times as many pages of ``L / G`` layers each.
"""

from __future__ import annotations

from typing import NamedTuple

from paged.config.engine_config import EngineConfig
from paged.kv.block_manager import BlockManager
from paged.kv.group_manager import GroupedBlockManager
from paged.kv.spec import KVSpec


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


def build_host_pool(config: EngineConfig, spec: KVSpec, *, on_free=None) -> HostPool:
    """The block manager and geometry of one replica's pool (``HostCore``'s).

    Args:
      config: the engine settings (pool geometry, prefix caching, swap slots, debug checks).
      spec: the replica's KV spec: its groups' windows, prefix-cache salt and host-tier slots.
      on_free: called with the block ids the pool frees (debug poisoning), or ``None``.
    """
    page_size, num_pages = config.pool_geometry()
    host_blocks = 0
    if config.preemption_mode == "swap":
        host_blocks = num_pages if config.num_host_blocks is None else config.num_host_blocks
    pages_per_seq = -(-config.max_model_len // page_size)
    caching = config.enable_prefix_caching and config.kv_layout == "paged"
    if spec.num_groups == 1:
        bm = BlockManager(
            num_pages, page_size, enable_prefix_caching=caching,
            cache_salt=spec.salt, quarantine_steps=config.quarantine_steps,
            num_host_blocks=host_blocks, debug=config.debug_checks, on_free=on_free,
            sliding_window=spec.group_windows[0], num_host_tier_blocks=spec.host_tier_blocks,
            prefix_eviction=config.prefix_eviction)
        return HostPool(bm, page_size, num_pages, pages_per_seq, host_blocks)
    # One table per group, interleaved in a row; pages of L / G layers each.
    G = spec.num_groups
    num_pages = G * (num_pages - 1) + 1
    if host_blocks:  # slots of one page each: G per block of the full-layer pool
        host_blocks = num_pages if config.num_host_blocks is None else G * config.num_host_blocks
    bm = GroupedBlockManager(
        num_pages, page_size, spec.group_windows, enable_prefix_caching=caching,
        cache_salt=spec.salt, quarantine_steps=config.quarantine_steps,
        num_host_blocks=host_blocks, debug=config.debug_checks, on_free=on_free)
    return HostPool(bm, page_size, num_pages, G * pages_per_seq, host_blocks)
