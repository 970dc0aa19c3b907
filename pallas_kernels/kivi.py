"""KIVI decode attention: closed packed pages plus the open page, merged as cascade merges.

A sequence of ``n`` tokens has ``n // page`` closed pages (quantized when they filled, in the
packed pool, :mod:`pallas_kernels.packed`) and ``n % page`` tokens in its *open page*, held in
the model dtype in a small buffer beside the pool (one page per sequence). Attention is two
partial online-softmax states over disjoint key ranges, the closed pages and the open page,
combined exactly with :func:`pallas_kernels.softmax.combine_states` (what cascade attention does
with its prefix and suffix passes). Nothing dequantizes the pool: the XLA path gathers one block
of packed pages per loop step and dequantizes only that tile.

Why a separate open page and not a partially quantized page: a per-channel key scale needs every
token of its group. KIVI keeps the last tokens in full precision until a group fills; in a paged
pool the group is the page, so the page is quantized exactly when it fills, and every later
read of it (any step, any chunking, after CoW or swap) sees the same values.

Implementations (``impl``): "reference" (jnp, dequantizes the pages a sequence reads), "xla"
(blocked online softmax, tile-wise dequantization), "auto" (= "xla"), "interpret_gpu" /
"pallas_gpu" (the GPU-style Pallas kernel of :mod:`pallas_kernels.kivi_gpu`), "interpret_tpu" /
"interpret" / "pallas_tpu" (the TPU-style kernel of :mod:`pallas_kernels.kivi_tpu`); interpret
mode on CPU, compiled: unverified. Every kernel unpacks and dequantizes a page tile inside the
kernel. :func:`ragged_paged_attention` serves token rows of several sequences (prefill chunks and
decodes) with the ragged TPU-style kernel, reading a sequence's pages once per row tile.
:func:`attention_np` is the float64 numpy oracle; :func:`dense_on_fill` the no-cache reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import packed, softmax
from pallas_kernels.packed import PackedPages

IMPLS = ("auto", "xla", "reference", "interpret_gpu", "pallas_gpu", "interpret_tpu", "interpret",
         "pallas_tpu")


def check_impl(impl: str) -> str:
    """The implementation serving ``impl`` ("xla", "reference", "interpret_gpu", "pallas_gpu",
    "interpret_tpu" or "pallas_tpu").

    Raises:
      ValueError: an unknown name (or "pallas", which picks a style by backend: name it).
    """
    if impl in ("auto", "xla"):
        return "xla"
    if impl == "interpret":
        return "interpret_tpu"
    if impl in IMPLS:
        return impl
    raise ValueError(f"impl={impl!r}: int4/int2 (KIVI) pages are read by impl in {IMPLS}")


def _check(q, k_pages, v_pages, open_k, open_v, lengths, page_indices):
    if not (isinstance(k_pages, PackedPages) and isinstance(v_pages, PackedPages)):
        raise TypeError("k_pages and v_pages must be PackedPages")
    if (k_pages.per, v_pages.per) != ("channel", "token"):
        raise ValueError(f"KIVI pages are keys per channel and values per token, got "
                         f"{k_pages.per!r} / {v_pages.per!r}")
    batch, hq, d = q.shape
    hkv, _, page, dk = k_pages.shape[-4:]
    if dk != d or tuple(v_pages.shape[-4:]) != tuple(k_pages.shape[-4:]) or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, k_pages {k_pages.shape}, v_pages {v_pages.shape}: "
                         f"head dims and pages must match and Hq a multiple of Hkv")
    expect = (batch, hkv, page, d)
    for name, x in (("open_k", open_k), ("open_v", open_v)):
        if tuple(x.shape) != expect:
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be {expect} [B, Hkv, page, D]")
    if tuple(lengths.shape) != (batch,) or page_indices.ndim != 2 or page_indices.shape[0] != batch:
        raise ValueError(f"lengths {tuple(lengths.shape)} must be [B={batch}] and page_indices "
                         f"{tuple(page_indices.shape)} [B, pages_per_seq]")
    return hkv, page


def paged_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: PackedPages,  # keys: values u8[(L,) Hkv, P, page, D*bits/8], scale/zero f16[.., D]
    v_pages: PackedPages,  # values: values u8[(L,) Hkv, P, page, D*bits/8], scale/zero [.., page]
    open_k: jax.Array,  # [B, Hkv, page, D] each sequence's open page (model dtype)
    open_v: jax.Array,  # [B, Hkv, page, D]
    lengths: jax.Array,  # i32[B] tokens of each sequence (closed: lengths // page * page)
    page_indices: jax.Array,  # i32[B, pages_per_seq] physical page of each closed logical page
    *,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    impl: str = "auto",
    layer=None,
    block_tokens: int = 128,
) -> jax.Array:  # [B, Hq, D] in q.dtype
    """Decode attention of one query per sequence over its closed packed pages and open page.

    Keys ``[0, lengths // page * page)`` are read from the packed pool through ``page_indices``,
    keys ``[lengths // page * page, lengths)`` from offsets ``[0, lengths % page)`` of the
    sequence's open page; open offsets past that (NaN included) and pages past the closed ones are
    never read. With ``layer``, the pools are stacked ``[L, ...]`` and layer ``layer`` is read.

    Raises:
      ValueError / TypeError: shapes that do not match, or an ``impl`` that cannot read packed
        pages (see :func:`check_impl`).
    """
    kind = check_impl(impl)
    kp, vp = (k_pages, v_pages) if layer is None else (k_pages[layer], v_pages[layer])
    hkv, page = _check(q, kp, vp, open_k, open_v, lengths, page_indices)
    batch, hq, d = q.shape
    lengths = lengths.astype(jnp.int32)
    closed = (lengths // page) * page
    qg = q.astype(jnp.float32).reshape(batch, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    if kind == "reference":
        cm, cl, cacc = _closed_state_ref(qg, kp, vp, closed, page_indices, sm_scale, soft_cap)
    elif kind in ("interpret_gpu", "pallas_gpu", "interpret_tpu", "pallas_tpu"):
        from pallas_kernels import kivi_gpu, kivi_tpu

        style = kivi_gpu if kind.endswith("gpu") else kivi_tpu
        cm, cl, cacc = style.closed_state(qg, kp, vp, closed, page_indices, sm_scale=sm_scale,
                                          soft_cap=soft_cap, interpret=kind.startswith("interpret"))
    else:
        cm, cl, cacc = _closed_state_xla(qg, k_pages, v_pages, closed, page_indices, sm_scale,
                                         soft_cap, layer, block_tokens)
    om, ol, oacc = _open_state(qg, open_k, open_v, lengths - closed, sm_scale, soft_cap)
    _, lsum, acc = softmax.combine_states(jnp.stack([cacc, oacc]), jnp.stack([cm, om]),
                                          jnp.stack([cl, ol]))
    return softmax.normalize(lsum, acc).reshape(q.shape).astype(q.dtype)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D] token rows, sequence by sequence
    k_pages: PackedPages,  # keys: values u8[(L,) Hkv, P, page, D*bits/8], scale/zero f16[.., D]
    v_pages: PackedPages,  # values: values u8[(L,) Hkv, P, page, D*bits/8], scale/zero [.., page]
    open_k: jax.Array,  # [T, Hkv, page, D] each row's open page (model dtype)
    open_v: jax.Array,  # [T, Hkv, page, D]
    row_len: jax.Array,  # i32[T] keys each row attends to (0: padding)
    row_seq: jax.Array,  # i32[T] the row's sequence
    page_indices: jax.Array,  # i32[S, pages_per_seq] each sequence's pages
    cu_rows: jax.Array,  # i32[S + 1] rows of sequence s: [cu_rows[s], cu_rows[s + 1])
    *,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    impl: str = "auto",
    layer=None,
    block_rows: int = 8,
) -> jax.Array:  # [T, Hq, D] in q.dtype
    """:func:`paged_attention` of token rows grouped by sequence: row ``r`` of sequence
    ``row_seq[r]`` reads that sequence's closed pages below ``row_len[r] // page * page`` and the
    first ``row_len[r] % page`` tokens of its own open page ``open_k[r]``. The TPU-style impls
    run the ragged kernel (:func:`pallas_kernels.kivi_tpu.ragged_closed_state`: a sequence's
    pages read once per row tile); the others read each row as a decode query through its
    sequence's table. ``block_rows``: token rows per tile of the ragged kernel.

    Raises:
      ValueError / TypeError: as :func:`paged_attention`.
    """
    kind = check_impl(impl)
    if kind not in ("interpret_tpu", "pallas_tpu"):
        return paged_attention(q, k_pages, v_pages, open_k, open_v, row_len,
                               page_indices[row_seq], sm_scale=sm_scale, soft_cap=soft_cap,
                               impl=impl, layer=layer)
    from pallas_kernels import kivi_tpu

    kp, vp = (k_pages, v_pages) if layer is None else (k_pages[layer], v_pages[layer])
    hkv, page = _check(q, kp, vp, open_k, open_v, row_len, page_indices[row_seq])
    t, hq, d = q.shape
    row_len = row_len.astype(jnp.int32)
    closed = row_len // page * page
    cm, cl, cacc = kivi_tpu.ragged_closed_state(q, kp, vp, row_len, row_seq, page_indices,
                                                cu_rows, sm_scale=sm_scale, soft_cap=soft_cap,
                                                interpret=kind == "interpret_tpu",
                                                block_rows=block_rows)
    qg = q.astype(jnp.float32).reshape(t, hkv, hq // hkv, d)
    om, ol, oacc = _open_state(qg, open_k, open_v, row_len - closed, sm_scale, soft_cap)
    _, lsum, acc = softmax.combine_states(jnp.stack([cacc, oacc]), jnp.stack([cm, om]),
                                          jnp.stack([cl, ol]))
    return softmax.normalize(lsum, acc).reshape(q.shape).astype(q.dtype)


def _open_state(qg, open_k, open_v, count, sm_scale, soft_cap):
    """State ``(m, l, acc)`` ``[B, Hkv, G(, D)]`` of each query over its open page's first
    ``count[b]`` tokens."""
    page = open_k.shape[2]
    k = open_k.astype(jnp.float32)
    valid = jnp.arange(page)[None, :] < count[:, None]  # [B, page]
    v = jnp.where(valid[:, None, :, None], open_v.astype(jnp.float32), 0.0)
    s = softmax.scale_scores(jnp.einsum("bhgd,bhkd->bhgk", qg, k), sm_scale=sm_scale,
                             soft_cap=soft_cap)
    init = softmax.initial_state(qg.shape[:3], qg.shape[3])
    return softmax.online_softmax_step(init, s, v, valid[:, None, None, :])


def _closed_state_ref(qg, kp, vp, closed, page_indices, sm_scale, soft_cap):
    """jnp reference: dequantizes each sequence's pages whole, one softmax."""
    batch, hkv, _, d = qg.shape
    page = kp.shape[-2]
    span = page_indices.shape[1] * page

    def seq(pages):  # -> f32[B, Hkv, span, D]
        x = packed.dequantize(pages)[:, page_indices]  # [Hkv, B, pps, page, D]
        return jnp.moveaxis(x, 1, 0).reshape(batch, hkv, span, d)

    valid = jnp.arange(span)[None, :] < closed[:, None]  # [B, span]
    k = jnp.where(valid[:, None, :, None], seq(kp), 0.0)
    v = jnp.where(valid[:, None, :, None], seq(vp), 0.0)
    s = softmax.scale_scores(jnp.einsum("bhgd,bhkd->bhgk", qg, k), sm_scale=sm_scale,
                             soft_cap=soft_cap)
    init = softmax.initial_state(qg.shape[:3], d)
    return softmax.online_softmax_step(init, s, v, valid[:, None, None, :])


def _closed_state_xla(qg, k_pages, v_pages, closed, page_indices, sm_scale, soft_cap, layer,
                      block_tokens):
    """Blocked online softmax over the closed pages: each loop step gathers one block of packed
    pages (values, scales, zeros) per sequence and dequantizes that tile only; the loop stops after
    the last block any sequence holds."""
    batch, hkv, _, d = qg.shape
    page = k_pages.values.shape[-2]
    pps = page_indices.shape[1]
    per_block = max(1, min(block_tokens // page, pps))
    num_blocks = -(-pps // per_block)
    table = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, num_blocks * per_block - pps)))
    block = per_block * page
    trips = jnp.minimum((jnp.max(closed) + block - 1) // block, num_blocks)

    def take(x, ids):  # [(L,) Hkv, P, ...] -> [B, Hkv, per_block, ...]
        return jnp.moveaxis(x[:, ids], 0, 1) if layer is None else jnp.swapaxes(
            x[layer, :, ids], 1, 2)

    def tile(pages: PackedPages, ids):  # -> f32[B, Hkv, block, D]
        x = packed.dequantize_tile(take(pages.values, ids), take(pages.scale, ids),
                                   take(pages.zero, ids), pages.bits, pages.per)
        return x.reshape(batch, hkv, block, d)

    def body(i, carry):
        ids = lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)  # [B, per_block]
        pos = i * block + jnp.arange(block)
        valid = pos[None, :] < closed[:, None]  # [B, block]
        v = jnp.where(valid[:, None, :, None], tile(v_pages, ids), 0.0)
        s = softmax.scale_scores(jnp.einsum("bhgd,bhkd->bhgk", qg, tile(k_pages, ids)),
                                 sm_scale=sm_scale, soft_cap=soft_cap)
        return softmax.online_softmax_step(carry, s, v, valid[:, None, None, :])

    init = softmax.initial_state(qg.shape[:3], d)
    return lax.fori_loop(0, trips, body, init)


# ----------------------------------------------------------------------------- references


def unpack_np(values: np.ndarray, bits: int) -> np.ndarray:  # u8[..., Dp] -> i64[..., D]
    """numpy unpack (independent of :func:`pallas_kernels.packed.unpack`): ``u8[..., Dp]`` ->
    ``int64[..., Dp * 8 / bits]``."""
    values = np.asarray(values).astype(np.int64)
    parts = [(values >> s) & ((1 << bits) - 1) for s in range(0, 8, bits)]
    return np.stack(parts, axis=-1).reshape(*values.shape[:-1], -1)


def dequantize_np(pages: PackedPages) -> np.ndarray:  # -> f64[..., Hkv, P, page, D]
    """float64 ``[..., Hkv, P, page, D]`` of a packed pool."""
    q = unpack_np(pages.values, pages.bits).astype(np.float64)
    s, z = (np.asarray(x, np.float64) for x in (pages.scale, pages.zero))
    if pages.per == "channel":
        return q * s[..., None, :] + z[..., None, :]
    return q * s[..., None] + z[..., None]


def attention_np(
    q,  # [B, Hq, D]
    k_pages: PackedPages,  # keys: values u8[Hkv, P, page, D*bits/8], scale/zero f16[Hkv, P, D]
    v_pages: PackedPages,  # values: values u8[Hkv, P, page, D*bits/8], scale/zero f16[Hkv, P, page]
    open_k,  # [B, Hkv, page, D]
    open_v,  # [B, Hkv, page, D]
    lengths,  # i32[B]
    page_indices,  # i32[B, pages_per_seq]
    *,
    sm_scale=1.0,
    soft_cap=None,
):  # -> f64[B, Hq, D]
    """float64 numpy KIVI decode attention; ``q [B, Hq, D]`` -> ``[B, Hq, D]`` float64. Slices
    exactly the valid keys (closed pages, then the open page's first tokens), so it never reads
    NaN padding."""
    q = np.asarray(q, np.float64)
    kd, vd = dequantize_np(k_pages), dequantize_np(v_pages)  # [Hkv, P, page, D]
    ok, ov = (np.asarray(x, np.float64) for x in (open_k, open_v))
    lengths, page_indices = np.asarray(lengths), np.asarray(page_indices)
    batch, hq, d = q.shape
    hkv, _, page, _ = kd.shape
    g = hq // hkv
    out = np.zeros((batch, hq, d))
    for b in range(batch):
        n = int(lengths[b])
        pages = page_indices[b, : n // page]
        for h in range(hkv):
            k = np.concatenate([kd[h, pages].reshape(-1, d), ok[b, h, : n % page]])
            v = np.concatenate([vd[h, pages].reshape(-1, d), ov[b, h, : n % page]])
            if n == 0:
                continue
            s = q[b, h * g:(h + 1) * g] @ k.T * sm_scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, h * g:(h + 1) * g] = (p / p.sum(-1, keepdims=True)) @ v
    return out


def fake_quantize_sequence(
    x: jax.Array,  # [B, S, Hkv, D]
    bits: int,
    per: str,
    page_size: int,
) -> jax.Array:  # f32[B, S, Hkv, D]
    """Every whole page of a contiguous sequence's K or V ``[B, S, Hkv, D]`` (position 0 at a
    page start) quantized and read back, float32; a trailing partial page is left as is."""
    b, s, h, d = x.shape
    full = (s // page_size) * page_size
    pages = x[:, :full].reshape(b, s // page_size, page_size, h, d).transpose(0, 3, 1, 2, 4)
    fq = packed.fake_quantize_page(pages, bits, per)  # [B, Hkv, n, page, D]
    fq = fq.transpose(0, 2, 3, 1, 4).reshape(b, full, h, d)
    return jnp.concatenate([fq, x[:, full:].astype(jnp.float32)], axis=1)


def dense_on_fill(
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [B, T, Hkv, D]
    v: jax.Array,  # [B, T, Hkv, D]
    *,
    bits: int,
    page_size: int,
    sm_scale: float,
    soft_cap: float | None = None,
) -> jax.Array:  # f32[B, T, Hq, D]
    """The no-cache reference of a KIVI engine (causal, float32): the query at position ``t``
    reads key/value ``j`` quantized when ``j``'s page is full at ``t`` (``(j // page + 1) * page
    <= t + 1``: the page was closed before or by ``t``'s write) and in full precision otherwise
    (the open page), the quantize-on-fill semantics of the paged cache."""
    bsz, t, hq, d = q.shape
    hkv = k.shape[2]
    kq = fake_quantize_sequence(k, bits, "channel", page_size)
    vq = fake_quantize_sequence(v, bits, "token", page_size)
    pos = jnp.arange(t)
    closed = ((pos[None, :] // page_size) + 1) * page_size <= pos[:, None] + 1  # [T(q), T(k)]
    causal = pos[None, :] <= pos[:, None]
    qg = q.astype(jnp.float32).reshape(bsz, t, hkv, hq // hkv, d)
    s_full = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32))
    s_quant = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kq)
    s = softmax.scale_scores(jnp.where(closed, s_quant, s_full), sm_scale=sm_scale,
                             soft_cap=soft_cap)
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    pc = jnp.where(closed, p, 0.0)
    out = (jnp.einsum("bhgqk,bkhd->bqhgd", pc, vq)
           + jnp.einsum("bhgqk,bkhd->bqhgd", p - pc, v.astype(jnp.float32)))
    return out.reshape(bsz, t, hq, d)
