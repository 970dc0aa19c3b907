"""Attention-mass state of KV policies (H2O, SnapKV, PyramidKV; ``paged.kv.policies``).

The per-slot f32 array ``KVCache.attn_mass`` ``[L, Hkv, P, page, 1]`` lives beside the key pages
and is owned by the cache (``paged.kv.cache``: part of ``key_side``, so copy-on-write, swap, the
host tier and hand-overs move it with its page). The jitted step adds each step's mass here
(``accumulate``); the compaction (``paged.engine.kv_compact``) moves the survivors' mass with
their keys and hands it to the policy's ``scores``.
"""

from __future__ import annotations

import jax.numpy as jnp

from paged.kv.cache import KVCache


def accumulate(cache: KVCache, mass, page_indices, kv_lens, slot_mapping) -> KVCache:
    """The cache with this step's attention mass added to its slots (traceable; a no-op without
    ``attn_mass``): the slots written this step (``slot_mapping``) start from 0, then ``mass``
    (f32[L, S, Hkv, pages_per_seq * page], per sequence slot in table order, as
    ``pallas_kernels.ragged_paged_attention`` returns it per layer) is added at each
    sequence's pages, slots past ``kv_lens`` dropped."""
    if cache.attn_mass is None:
        return cache
    L, H, P, B, _ = cache.attn_mass.shape
    flat = cache.attn_mass.reshape(L, H, P * B)
    flat = flat.at[:, :, slot_mapping].set(0.0, mode="drop")
    j = jnp.arange(mass.shape[-1], dtype=jnp.int32)
    slot = page_indices[:, j // B] * B + j % B  # [S, R]
    slot = jnp.where(j[None, :] < kv_lens[:, None], slot, P * B)  # out of range: dropped
    add = jnp.moveaxis(mass, 2, 1).reshape(L, H, -1)  # [L, H, S * R]
    flat = flat.at[:, :, slot.reshape(-1)].add(add, mode="drop")
    return cache.replace(attn_mass=flat.reshape(L, H, P, B, 1))


__all__ = ["accumulate"]
