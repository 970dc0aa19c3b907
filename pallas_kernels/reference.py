"""Pure-jnp references for every attention op, written for clarity, not speed.

Each reference upcasts to float32, materialises the full score matrix and masks with ``jnp.where``
(never by multiplying), so a NaN stored at a position a query must not see cannot leak into its
output. They are the ground truth the kernels and the fast ``"xla"`` path are tested against (and
they are themselves checked against float64 numpy and a hand-computed case).

Conventions shared by all ops:
  * scores are ``q . k * sm_scale``, then ``soft_cap * tanh(scores / soft_cap)`` when ``soft_cap`` is
    set (Gemma-2 style), then masked, then softmax;
  * a query that sees no key (length 0, padding) outputs zeros;
  * the output has ``q.dtype``;
  * quantized pages (``quant.QuantizedPages``) are dequantized whole, in float32, first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cascade, quant, softmax, validation


def masked_softmax_attend(
    q: jax.Array,  # f32[..., G, D]
    k: jax.Array,  # [..., S, D]
    v: jax.Array,  # [..., S, D]
    mask: jax.Array,  # bool[..., G or 1, S]
    *,
    sm_scale: float,
    soft_cap: float | None,
    kv_valid: jax.Array | None = None,  # bool[..., S]; default: seen by some query of the group
) -> jax.Array:  # f32[..., G, D]
    """Softmax attention over the last axis of ``k``/``v``, float32, masked positions never used.

    ``kv_valid`` marks the value rows that hold data (may be NaN elsewhere); it only needs to cover
    every position some query sees.
    """
    k = k.astype(jnp.float32)
    v = v.astype(jnp.float32)
    s = jnp.einsum("...gd,...sd->...gs", q.astype(jnp.float32), k)
    s = softmax.scale_scores(s, sm_scale=sm_scale, soft_cap=soft_cap)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # p is 0 at hidden positions, but 0 * NaN = NaN: zero unused value rows before p @ v.
    if kv_valid is None:
        kv_valid = jnp.any(mask, axis=-2)
    v = jnp.where(kv_valid[..., None], v, 0.0)
    return softmax.normalize(denom, jnp.einsum("...gs,...sd->...gd", p, v))


def masked_probs(q, k, mask, *, sm_scale: float, soft_cap: float | None):
    """The softmax probabilities ``f32[..., G, S]`` of :func:`masked_softmax_attend` (0 where
    masked; a query that sees no key has none)."""
    s = jnp.einsum("...gd,...sd->...gs", q.astype(jnp.float32), k.astype(jnp.float32))
    s = jnp.where(mask, softmax.scale_scores(s, sm_scale=sm_scale, soft_cap=soft_cap), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(den > 0, den, 1.0)


def paged_attention(q, k_pages, v_pages, lengths, page_indices, *, sm_scale=1.0, soft_cap=None,
                    sliding_window=None, mass_weight=None):
    """Decode attention of one query token per sequence over its paged KV (reference; arguments
    as in :func:`pallas_kernels.paged_attention`, ``mass_weight`` too)."""
    shp = validation.check_paged_attention(
        q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale, soft_cap=soft_cap
    )
    k_pages, v_pages = quant.as_float(k_pages), quant.as_float(v_pages)
    validation.check_sliding_window(sliding_window)
    return _attend_pages(q, k_pages, v_pages, page_indices, lengths, shp, sm_scale=sm_scale,
                         soft_cap=soft_cap, sliding_window=sliding_window,
                         mass_weight=mass_weight)  # fmt: skip


def paged_attention_state(q, k_pages, v_pages, lengths, page_indices, *, sm_scale=1.0,
                          soft_cap=None):  # fmt: skip
    """The unnormalised online-softmax state of :func:`paged_attention` (reference):
    ``(m f32[B, Hq], l f32[B, Hq], acc f32[B, Hq, D])`` with ``m`` the row max of the visible
    scores (``-inf`` for no key), ``l = sum exp(s - m)`` and ``acc = sum exp(s - m) v``."""
    shp = validation.check_paged_attention(
        q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale, soft_cap=soft_cap
    )
    rows, seq_len = q.shape[0], shp.pages_per_seq * shp.page_size

    def gather(pages):  # -> f32[R, Hkv, S, D]
        g = pages[:, page_indices].reshape(shp.num_kv_heads, rows, seq_len, shp.head_dim)
        return jnp.swapaxes(g, 0, 1).astype(jnp.float32)

    qg = q.reshape(rows, shp.num_kv_heads, shp.group, shp.head_dim).astype(jnp.float32)
    mask = (jnp.arange(seq_len)[None, :] < lengths[:, None])[:, None, None, :]  # [R, 1, 1, S]
    s = jnp.einsum("rhgd,rhsd->rhgs", qg, gather(k_pages))
    s = jnp.where(mask, softmax.scale_scores(s, sm_scale=sm_scale, soft_cap=soft_cap), -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    v = jnp.where(mask[:, :, 0, :, None], gather(v_pages), 0.0)
    acc = jnp.einsum("rhgs,rhsd->rhgd", p, v)
    return m.reshape(q.shape[:2]), jnp.sum(p, axis=-1).reshape(q.shape[:2]), acc.reshape(q.shape)


def cascade_paged_attention(q, k_pages, v_pages, lengths, page_indices, group_rows, prefix_lens,
                            *, sm_scale=1.0, soft_cap=None):  # fmt: skip
    """Cascade (shared-prefix) decode attention (reference; arguments as in
    :func:`pallas_kernels.cascade_paged_attention`): the two passes of
    :func:`pallas_kernels.cascade.cascade` over :func:`paged_attention_state`."""
    shp, _, _ = validation.check_cascade_paged_attention(
        q, k_pages, v_pages, lengths, page_indices, group_rows, prefix_lens, sm_scale=sm_scale,
        soft_cap=soft_cap,
    )  # fmt: skip
    state_fn = lambda *a: paged_attention_state(*a, sm_scale=sm_scale, soft_cap=soft_cap)  # noqa: E731
    return cascade.cascade(state_fn, *map(jnp.asarray, (q, k_pages, v_pages, lengths, page_indices,
                                                        group_rows, prefix_lens)),
                           num_kv_heads=shp.num_kv_heads, page_size=shp.page_size)  # fmt: skip


def window_start(limit: jax.Array, sliding_window: int | None) -> jax.Array:
    """First key a query that sees keys below ``limit`` (its position + 1) may see: 0, or
    ``limit - sliding_window`` clipped at 0 (keys ``[p - W + 1, p]`` for position ``p``)."""
    if sliding_window is None:
        return jnp.zeros_like(limit)
    return jnp.maximum(limit - sliding_window, 0)


def _attend_pages(q, k_pages, v_pages, tables, limit, shp, *, sm_scale, soft_cap,
                  sliding_window=None, mass_weight=None, hole=None):
    """Row ``r`` of ``q`` [R, Hq, D] attends to keys ``[lo, limit[r])`` of the pages ``tables[r]``
    (i32[R, pages_per_seq]), gathering the whole page list of every row; ``lo`` is 0, or
    ``limit[r] - sliding_window`` with a window. With ``mass_weight`` (f32[R]) also returns each
    row's attention mass f32[R, Hkv, S]: ``mass_weight[r]`` x the probabilities summed over the
    row's query heads of each KV head. With ``hole`` (i32[R, 2]) keys ``[hole[r, 0], hole[r,
    1])`` are not seen."""
    rows = q.shape[0]
    seq_len = shp.pages_per_seq * shp.page_size

    def gather(pages):  # -> [R, Hkv, S, D]
        g = pages[:, tables]  # [Hkv, R, pages_per_seq, page, D]
        return jnp.swapaxes(g.reshape(shp.num_kv_heads, rows, seq_len, shp.head_dim), 0, 1)

    qg = q.reshape(rows, shp.num_kv_heads, shp.group, shp.head_dim)
    j = jnp.arange(seq_len)[None, :]
    mask = (j < limit[:, None]) & (j >= window_start(limit, sliding_window)[:, None])  # [R, S]
    if hole is not None:
        mask = mask & ((j < hole[:, :1]) | (j >= hole[:, 1:]))
    out = masked_softmax_attend(qg, gather(k_pages), gather(v_pages), mask[:, None, None, :],
                                sm_scale=sm_scale, soft_cap=soft_cap)  # fmt: skip
    out = out.reshape(q.shape).astype(q.dtype)
    if mass_weight is None:
        return out
    p = masked_probs(qg, gather(k_pages), mask[:, None, None, :], sm_scale=sm_scale,
                     soft_cap=soft_cap)  # fmt: skip
    return out, jnp.sum(p, axis=2) * jnp.asarray(mass_weight, jnp.float32)[:, None, None]


def ragged_token_layout(
    num_tokens: int,
    kv_lens: jax.Array,  # i32[max_num_seqs]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1] | int
) -> tuple[jax.Array, jax.Array]:
    """Maps each token row of a ragged batch to its sequence and causal key limit.

    Returns:
      ``(seq, limit)``, both i32[num_tokens]: ``seq[t]`` is the sequence that owns row ``t`` (clamped
      into range for padding rows) and ``limit[t]`` the number of keys row ``t`` may see
      (``position + 1``; 0 for padding rows and rows whose position would be negative).
    """
    max_num_seqs = kv_lens.shape[0]
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    n = jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, max_num_seqs - 1)
    valid = (t < cu_q_lens[n]) & (seq < n)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq].astype(jnp.int32) - q_len + (t - cu_q_lens[seq])
    limit = jnp.where(valid, jnp.maximum(pos + 1, 0), 0)
    return seq, limit


def ragged_paged_attention(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=1.0,
    soft_cap=None, sliding_window=None, mass_weight=None, kv_holes=None,
):  # fmt: skip
    """Causal attention for a mixed batch of prefill chunks, decodes and verifications (reference;
    arguments as in :func:`pallas_kernels.ragged_paged_attention`, ``mass_weight`` too).

    Gathers each token's whole page list; fine for tests, too big for production shapes.
    """
    shp = validation.check_ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    validation.check_sliding_window(sliding_window)
    seq, limit = ragged_token_layout(q.shape[0], kv_lens, cu_q_lens, num_seqs)
    k_pages, v_pages = quant.as_float(k_pages), quant.as_float(v_pages)
    out = _attend_pages(q, k_pages, v_pages, page_indices[seq], limit, shp, sm_scale=sm_scale,
                        soft_cap=soft_cap, sliding_window=sliding_window,
                        mass_weight=mass_weight,
                        hole=None if kv_holes is None else jnp.asarray(kv_holes)[seq])  # fmt: skip
    if mass_weight is None:
        return out
    out, rows = out  # [T, Hkv, S]: padding rows see no key (0)
    return out, jnp.zeros((kv_lens.shape[0], *rows.shape[1:]), jnp.float32).at[seq].add(rows)


def flash_attention(q, k, v, *, kv_lens=None, causal=True, sm_scale=1.0, soft_cap=None):
    """Contiguous (GQA) attention; queries are the last ``Tq`` of ``kv_lens[b]`` tokens (reference;
    arguments as in :func:`pallas_kernels.flash_attention`)."""
    batch, q_len, kv_len, hq, hkv, d = validation.check_flash_attention(
        q, k, v, kv_lens, causal=causal, sm_scale=sm_scale, soft_cap=soft_cap
    )
    if kv_lens is None:
        kv_lens = jnp.full((batch,), kv_len, jnp.int32)
    mask = flash_mask(kv_lens, q_len, kv_len, causal=causal)  # [B, Tq, Tk]
    qg = q.reshape(batch, q_len, hkv, hq // hkv, d).transpose(0, 2, 1, 3, 4)  # [B, Hkv, Tq, G, D]
    kt = jnp.swapaxes(k, 1, 2)[:, :, None]  # [B, Hkv, 1, Tk, D]
    vt = jnp.swapaxes(v, 1, 2)[:, :, None]
    kv_valid = (jnp.arange(kv_len)[None, :] < kv_lens[:, None])[:, None, None, :]  # [B, 1, 1, Tk]
    out = masked_softmax_attend(
        qg, kt, vt, mask[:, None, :, None, :], sm_scale=sm_scale, soft_cap=soft_cap,
        kv_valid=kv_valid,
    )  # [B, Hkv, Tq, G, D]  # fmt: skip
    return out.transpose(0, 2, 1, 3, 4).reshape(q.shape).astype(q.dtype)


def flash_mask(
    kv_lens: jax.Array,  # i32[B]
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
) -> jax.Array:  # bool[B, Tq, Tk]
    """Which key each query may see: ``j < kv_lens[b]`` and, if causal, ``j <= kv_lens[b] - Tq + i``."""
    j = jnp.arange(kv_len)[None, None, :]
    lens = kv_lens.astype(jnp.int32)[:, None, None]
    mask = j < lens
    if causal:
        pos = lens - q_len + jnp.arange(q_len)[None, :, None]
        mask = mask & (j <= pos)
    return mask
