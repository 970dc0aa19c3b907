"""The device half of a KV policy's call: score, select and compact one sequence's slots.

One jitted function per (region pages bucket): it gathers the sequence's private region
(``CompactOp``, `paged.step.kv_policy_runner`), asks the policy for a score per slot and (layer,
KV head) with each slot's original position, keeps the ``num_kept`` best of each (layer, KV
head) in slot order and writes them into the region's first slots; writes past them go to the
null page, so the freed pages' content is untouched (a freed block that is still keyed stays a
valid prefix-cache entry). Keys are stored after RoPE: a survivor keeps its rotation, so
attention needs no position, only the slot count (``kv_lens``). A cache with attention mass
(`paged.kv.mass`) hands the region's mass to the policy and moves the survivors' with them.

Each compacted sequence has a device record of its slots' original positions (i32[L, Hkv,
S], in a ``PosRecord`` the sequence holds), so a later call of a position-aware policy
(StreamingLLM's recency) sees the true positions; slots at or past the record's count hold
position ``slot + dropped``. The records are device arrays, never read back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged.kv.cache import KVCache, next_pow2
from paged.kv.paging import NULL_PAGE


@functools.partial(jax.jit, static_argnames=("policy",), donate_argnums=(0,))
def _compact(cache: KVCache, region, meta, record, layer_kept, policy):
    """``region`` i32[Pp]: pages (NULL_PAGE padded); ``meta`` i32[5]: region slots, kept, first
    slot, dropped before, record count; ``record`` i32[L, Hkv, S]; ``layer_kept`` i32[L]: slots
    each layer keeps (<= kept; a layer's slots past its own count hold other tokens, hidden
    from it by the attention's holes). Returns (cache, new record, its count)."""
    k_all, v_all = cache.k_pages, cache.v_pages
    L, H, _, B, D = k_all.shape
    R = region.shape[0] * B
    n_region, n_kept, start, dropped, count = (meta[i] for i in range(5))
    idx = jnp.arange(R, dtype=jnp.int32)
    S = record.shape[-1]
    # Original positions of the region's slots (record, or slot + dropped past it).
    j = start + idx
    pos = jnp.where(j < count, record[:, :, jnp.clip(j, 0, S - 1)], j + dropped)
    k = k_all[:, :, region].reshape(L, H, R, D)
    v = v_all[:, :, region].reshape(L, H, R, D)
    valid = idx < n_region
    mass = None
    if cache.attn_mass is not None:  # the slots' attention mass moves with their keys
        mass = cache.attn_mass[:, :, region].reshape(L, H, R)
        mass = jnp.where(valid, mass, 0.0)  # a freed page's slots may hold NaN (debug poison)
    score = policy.scores(jnp, k, pos, valid, mass=mass).astype(jnp.float32)
    score = jnp.where(valid, score, -jnp.inf)
    order = jnp.argsort(-score, axis=-1, stable=True)  # best first, ties to the earlier slot
    rank = jnp.argsort(order, axis=-1)
    keep = (rank < jnp.minimum(layer_kept, n_kept)[:, None, None]) & valid
    sel = jnp.argsort(jnp.where(keep, idx, R + idx), axis=-1)  # the kept, in slot order, first
    k_new = jnp.take_along_axis(k, sel[..., None], axis=2)
    v_new = jnp.take_along_axis(v, sel[..., None], axis=2)
    pos_new = jnp.take_along_axis(pos, sel, axis=2)
    dst_page = jnp.where(idx < n_kept, region[idx // B], NULL_PAGE)
    dst_off = idx % B
    k_all = k_all.at[:, :, dst_page, dst_off].set(k_new.astype(k_all.dtype))
    v_all = v_all.at[:, :, dst_page, dst_off].set(v_new.astype(v_all.dtype))
    if mass is not None:
        m_new = jnp.take_along_axis(mass, sel, axis=2)[..., None]
        cache = cache.replace(attn_mass=cache.attn_mass.at[:, :, dst_page, dst_off].set(m_new))
    # The new record: slots before the region as they were, then the survivors' positions.
    js = jnp.arange(S, dtype=jnp.int32)
    before = jnp.where(js < count, record, js + dropped)
    after = pos_new[:, :, jnp.clip(js - start, 0, R - 1)]
    new_record = jnp.where(js < start, before, jnp.where(js - start < n_kept, after, 0))
    return cache.replace(k_pages=k_all, v_pages=v_all), new_record, start + n_kept


class Compactor:
    """Runs ``CompactOp`` lists on an engine's cache; each op's new position record goes into
    its ``pos_dst`` holder (``PosRecord``), which the sequence keeps.

    Args:
      policy: the ``KVPolicy`` (its ``scores`` is traced into the jitted compaction).
      num_layers, num_kv_heads: the cache's; max_slots: slots of one sequence at most.
    """

    def __init__(self, policy, num_layers: int, num_kv_heads: int, max_slots: int):
        self.policy = policy
        self.shape = (num_layers, num_kv_heads, max_slots)
        self._empty = None

    @classmethod
    def build(cls, runner, cache: KVCache, max_slots: int) -> Compactor | None:
        """The compactor of an engine whose host core has ``runner`` (None: no policy)."""
        if runner is None:
            return None
        return cls(runner.policy, cache.num_layers, cache.num_kv_heads, max_slots)

    def run(self, cache: KVCache, ops) -> KVCache:
        """Applies ``ops`` in order; returns the new cache (the argument is donated)."""
        for op in ops:
            plan = op.plan
            pages = np.full(next_pow2(len(plan.region)), NULL_PAGE, np.int32)
            pages[:len(plan.region)] = plan.region
            if op.pos_src is not None and op.pos_src.arrays is not None:
                record, count = op.pos_src.arrays
            else:
                if self._empty is None:
                    self._empty = jnp.zeros(self.shape, jnp.int32)
                record, count = self._empty, 0
            meta = jnp.stack([jnp.int32(plan.num_region), jnp.int32(plan.num_kept),
                              jnp.int32(op.start), jnp.int32(op.dropped_before),
                              jnp.asarray(count, jnp.int32)])
            kept = np.full(self.shape[0], plan.num_kept, np.int32) if op.layer_kept is None \
                else np.asarray(op.layer_kept, np.int32)
            cache, record, count = _compact(cache, jnp.asarray(pages), meta, record,
                                            jnp.asarray(kept), self.policy)
            op.pos_dst.arrays = (record, count)
        return cache


__all__ = ["Compactor"]
