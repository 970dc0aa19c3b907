"""The host tier's bytes: numpy slots in the cache's page layout, and the step's tier copies.

The bookkeeping (which slot holds which key, when a copy runs) is `paged.kv.blocks.host_tier`'s; this
object only moves bytes, in the order ``apply`` documents. Slots are plain numpy arrays (pageable
host memory; JAX offers no portable pinned-host allocation for CPU and GPU alike), shaped like the
cache with the page axis resized: ``[num_layers, num_kv_heads, num_slots, page_size, head_dim]``
per leaf, so a slot holds every layer and every KV head of one block (all tensor-parallel shards'
heads: the read gathers them), and the scales of a quantized cache beside its values.

An offload is asynchronous: ``apply`` dispatches the device read of the evicted pages (ordered
before the step that follows it on the same cache, which donates it) and keeps the result on
device; the bytes reach the host slots at the next ``apply`` (or ``flush``), by which time the
step between has usually finished the read. Loads always flush first, so they read what the
bookkeeping says the slot holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged.kv import cache as kc
from paged.kv.cache import KVCache


class HostTierStore:
    """Host slots for one KV cache (a draft model's cache has its own, fed the same copies).

    Args:
      cache: the device cache whose layout the slots take.
      num_slots: host-tier slots (the block manager's ``num_host_tier_blocks``).
      poison: debug: fill slots whose content died with NaN (float leaves; an int8 cache's
        scales), so that a load of a dead slot spoils the output.
    """

    def __init__(self, cache: KVCache, num_slots: int, *, poison: bool = False):
        self.k, self.v = kc.host_buffers(cache, num_slots)
        self.poison = poison
        self._pending: list[tuple[list[int], tuple]] = []  # (slots, device read) not on host yet

    @property
    def nbytes(self) -> int:
        """Bytes of the slots (values and scales)."""
        return sum(int(x.nbytes) for x in jax.tree.leaves((self.k, self.v)))

    def flush(self) -> None:
        """Waits for the offload reads dispatched so far and writes them into their slots."""
        for slots, read in self._pending:
            k, v = kc.to_host(read, len(slots))
            kc.host_set(self.k, slots, k)
            kc.host_set(self.v, slots, v)
        self._pending = []

    def apply(self, cache: KVCache, copies, *, phase: str) -> KVCache:
        """Applies one step's ``TierCopies`` in two phases around the step's other copies.

        ``phase="offload"`` (first among the step's copies, before poison and writes): earlier
        offloads reach their slots, dead slots are poisoned (debug), and the device reads of this
        step's evicted pages are dispatched. ``phase="load"`` (after poison and swap-in): the
        loads, one batched host-to-device copy. DONATES ``cache`` in the load phase.
        """
        if copies is None:
            return cache
        if phase == "offload":
            self.flush()
            if self.poison and copies.died:
                self._poison(sorted(set(copies.died)))
            if copies.offload:
                pages, slots = map(list, zip(*copies.offload, strict=True))
                self._pending.append((slots, kc.read_pages(cache, pages)))
            return cache
        if copies.load:
            self.flush()
            slots, pages = map(list, zip(*copies.load, strict=True))
            cache = kc.swap_in(cache, pages, kc.host_get(self.k, slots),
                               kc.host_get(self.v, slots))
        return cache

    def warm(self, cache: KVCache) -> KVCache:
        """Compiles the offload read and the load write for every padded page count (powers of
        two up to the pool), writing the null page only (no slot changes), so no request pays
        for it. DONATES ``cache``."""
        n = 1
        while True:
            pages = [kc.NULL_PAGE] * n
            jax.block_until_ready(kc.read_pages(cache, pages))  # read only: no slot written
            cache = kc.swap_in(cache, pages, kc.host_get(self.k, [0] * n),
                               kc.host_get(self.v, [0] * n))
            if n >= cache.num_pages:
                return cache
            n *= 2

    def _poison(self, slots: list[int]) -> None:
        def nan(x):
            if jnp.issubdtype(x.dtype, jnp.floating):
                x[:, :, slots] = np.nan

        jax.tree.map(nan, (self.k, self.v))
