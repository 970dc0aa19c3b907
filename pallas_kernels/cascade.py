"""Cascade (shared-prefix) decode attention: a shared prefix's pages read once for its whole group.

When several decoding sequences' page tables start with the same physical pages (a shared system
prompt from the prefix cache, or the ``n`` samples forked from one prompt), ordinary paged
attention reads those pages once per sequence. Cascade attention splits each sequence's keys in
two disjoint ranges and merges their online-softmax states exactly (log-sum-exp):

1. **prefix**: per group, the shared pages, attended by all the group's query rows at once. The
   rows of the group's ``R`` members become one query tile of ``R * G`` rows per KV head, so the
   pass is ordinary paged attention over ``num_groups`` "sequences" with ``Hq' = Hkv * R * G``
   query heads: each prefix page is read once per group and KV head.
2. **suffix**: per sequence, its own pages after the prefix: ordinary paged attention over the
   page table shifted by the prefix's pages, with ``lengths - prefix``.

Both passes run the same "state" flavour of a paged kernel (``paged_attention_state`` of each
style: ``(m, l, acc)`` unnormalised), so every style (reference, XLA, TPU-style and GPU-style
Pallas) gets cascade from its own decode kernel; :func:`cascade` is the style-independent glue.
Shared prefixes are whole pages: ``prefix_lens`` is rounded down to a multiple of the page size,
and whatever lies past it (a partial page included) is read by the suffix pass.

Bytes read (K and V, one layer): ordinary ``2 * Hkv * D * b * sum_i ceil_pages(len_i)``;
cascade reads each group's prefix once instead of once per member (:func:`kv_bytes_read`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import softmax


def cascade(
    state_fn,
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, page, D] (or what state_fn takes)
    v_pages: jax.Array,  # [Hkv, P, page, D]
    lengths: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    group_rows: jax.Array,  # i32[NG, R]: member sequences of each group, -1 = empty slot
    prefix_lens: jax.Array,  # i32[NG]: shared tokens of each group (whole pages)
    *,
    num_kv_heads: int,
    page_size: int,
) -> jax.Array:  # [B, Hq, D]
    """Two-level attention from a paged kernel's state function.

    ``state_fn(q, k_pages, v_pages, lengths, page_indices) -> (m f32[B', Hq'], l f32[B', Hq'],
    acc f32[B', Hq', D])`` is the state flavour of paged decode attention. A group whose first
    slot is -1 is padding (reads nothing). The group's shared pages are taken from its first
    member's table. Each sequence may be in at most one group; a sequence in no group reads all
    its pages in the suffix pass.
    """
    batch, num_q_heads, head_dim = q.shape
    num_groups, size = group_rows.shape
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]
    rows_ok = group_rows >= 0
    members = jnp.clip(group_rows, 0, batch - 1)
    prefix_pages = jnp.where(rows_ok[:, 0], prefix_lens.astype(jnp.int32) // page_size, 0)

    # Prefix pass: group g's R members x G heads as one tile per KV head.
    qg = q[members].reshape(num_groups, size, num_kv_heads, group, head_dim)
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(num_groups, num_kv_heads * size * group, head_dim)
    pm, pl, pacc = state_fn(qg, k_pages, v_pages, prefix_pages * page_size,
                            page_indices[members[:, 0]])  # fmt: skip

    def to_members(x):  # [NG, Hkv * R * G, ...] -> [NG, R, Hq, ...]
        x = x.reshape(num_groups, num_kv_heads, size, group, *x.shape[2:])
        return jnp.moveaxis(x, 2, 1).reshape(num_groups, size, num_q_heads, *x.shape[4:])

    # Each sequence's group and slot (scatter; empty slots dropped).
    target = jnp.where(rows_ok, group_rows, batch).reshape(-1)
    ids = jnp.arange(num_groups * size, dtype=jnp.int32)
    where = jnp.full((batch,), -1, jnp.int32).at[target].set(ids, mode="drop")
    in_group = where >= 0
    g_of, r_of = jnp.maximum(where, 0) // size, jnp.maximum(where, 0) % size
    seq_prefix = jnp.where(in_group, prefix_pages[g_of], 0)  # pages
    col = in_group[:, None]
    pm = jnp.where(col, to_members(pm)[g_of, r_of], -jnp.inf)
    pl = jnp.where(col, to_members(pl)[g_of, r_of], 0.0)
    pacc = jnp.where(col[..., None], to_members(pacc)[g_of, r_of], 0.0)

    # Suffix pass: each sequence's table shifted past its prefix.
    cols = jnp.minimum(jnp.arange(pages_per_seq)[None, :] + seq_prefix[:, None], pages_per_seq - 1)
    suffix_table = jnp.take_along_axis(page_indices, cols, axis=1)
    suffix_lens = jnp.maximum(lengths.astype(jnp.int32) - seq_prefix * page_size, 0)
    sm, sl, sacc = state_fn(q, k_pages, v_pages, suffix_lens, suffix_table)

    _, lsum, acc = softmax.combine_states(
        jnp.stack([pacc, sacc]), jnp.stack([pm, sm]), jnp.stack([pl, sl])
    )
    return softmax.normalize(lsum, acc).astype(q.dtype)


def kv_bytes_read(lengths, groups, prefix_lens, *, page_size: int, bytes_per_token: int) -> dict:
    """K/V bytes one layer reads for a decode batch, ordinary vs cascade (host-side count).

    Counts whole pages (a kernel reads a page it touches): ordinary reads ``ceil(len_i / page)``
    pages per sequence; cascade reads each group's ``prefix // page`` pages once and every
    sequence's remaining pages.

    Args:
      lengths: tokens per sequence.
      groups: member sequence indices of each group (lists).
      prefix_lens: shared tokens of each group.
      page_size: tokens per page.
      bytes_per_token: K and V bytes of one token in one layer (``2 * Hkv * D * itemsize``).

    Returns:
      ``{"ordinary": int, "cascade": int, "saved": int}`` bytes.
    """
    lengths = np.asarray(lengths, np.int64)
    pages = -(-lengths // page_size)
    ordinary = int(pages.sum())
    cascade_pages = ordinary
    for members, prefix in zip(groups, prefix_lens, strict=True):
        shared = int(prefix) // page_size
        cascade_pages -= (len(members) - 1) * shared
    per_page = page_size * bytes_per_token
    return {"ordinary": ordinary * per_page, "cascade": cascade_pages * per_page,
            "saved": (ordinary - cascade_pages) * per_page}
