"""GPU-style Pallas state of KIVI decode attention over the closed packed pages.

Grid ``(batch, num_kv_heads)``: each program walks its sequence's closed pages one at a time,
loads the page's packed values and its float16 scales and zeros, unpacks and dequantizes them in
registers (`pallas_kernels.packed.dequantize_tile`) and folds the page into an online softmax of
the ``G`` query heads of its KV head (one ``[block_h, D]`` tile). Closed pages are always full,
so no lane inside a page is masked and the loop stops at ``closed // page`` pages: a page past
them (the null page, garbage) is never loaded. The open page and the merge are
`pallas_kernels.kivi`'s (jnp).

Only ``interpret=True`` is tested (on CPU); the compiled Triton lowering of the sub-byte unpack
(shifts and a reshape of uint8 lanes) is unverified here (no GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, gpu_common, packed, softmax
from pallas_kernels.gpu_common import GpuPagedConfig, next_pow2


def _kernel(
    q_ref,  # [block_h, D]
    kv_ref,  # u8[P, page, D * bits / 8] keys of this KV head
    ks_ref,  # f16[P, D] key scales (per channel)
    kz_ref,  # f16[P, D] key zeros
    vv_ref,  # u8[P, page, D * bits / 8] values
    vs_ref,  # f16[P, page] value scales (per token)
    vz_ref,  # f16[P, page] value zeros
    table_ref,  # i32[pages_per_seq]
    closed_ref,  # i32[1] closed tokens (a multiple of page)
    o_ref,  # f32[block_h, D] unnormalised
    m_ref,  # f32[block_h]
    l_ref,  # f32[block_h]
    *,
    bits: int,
    sm_scale: float,
    soft_cap: float | None,
):
    page = kv_ref.shape[1]
    q = q_ref[...].astype(jnp.float32)

    def body(i, carry):
        p = table_ref[i]
        k = packed.dequantize_tile(kv_ref[p], ks_ref[p], kz_ref[p], bits, "channel")  # [page, D]
        v = packed.dequantize_tile(vv_ref[p], vs_ref[p], vz_ref[p], bits, "token")  # [page, D]
        s = softmax.scale_scores(gpu_common.dot(q, k, trans_b=True), sm_scale=sm_scale,
                                 soft_cap=soft_cap)
        return softmax.online_softmax_step(carry, s, v, True, pv=gpu_common.dot)

    init = softmax.initial_state(q.shape[:1], q.shape[1])
    m, lsum, acc = lax.fori_loop(0, closed_ref[0] // page, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = lsum


def closed_state(
    qg: jax.Array,  # f32[B, Hkv, G, D]
    k_pages: packed.PackedPages,  # values u8[Hkv, P, page, D*bits/8], scale/zero f16[Hkv, P, D]
    v_pages: packed.PackedPages,  # values u8[Hkv, P, page, D*bits/8], scale/zero [Hkv, P, page]
    closed: jax.Array,  # i32[B] closed tokens per sequence
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None,
    interpret: bool,
    config: GpuPagedConfig | None = None,
):  # -> (m f32[B, Hkv, G], l f32[B, Hkv, G], acc f32[B, Hkv, G, D])
    """The online-softmax state of each query over its closed packed pages."""
    if not interpret:
        compat.require_triton()
    batch, hkv, group, d = qg.shape
    block_h = max(16, next_pow2(group))
    q4 = jnp.pad(qg, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
    pps = page_indices.shape[1]

    def head(x):  # one KV head's whole pages
        return pl.BlockSpec((None, *x.shape[1:]), lambda b, h: (h,) + (0,) * (x.ndim - 1))

    leaves = (k_pages.values, k_pages.scale, k_pages.zero, v_pages.values, v_pages.scale,
              v_pages.zero)
    kernel = functools.partial(_kernel, bits=k_pages.bits, sm_scale=float(sm_scale),
                               soft_cap=soft_cap)
    o, m, lsum = gpu_common.pallas_call(
        kernel,
        grid=(batch, hkv),
        in_specs=[pl.BlockSpec((None, None, block_h, d), lambda b, h: (b, h, 0, 0)),
                  *(head(x) for x in leaves),
                  pl.BlockSpec((None, pps), lambda b, h: (b, 0)),
                  pl.BlockSpec((None, 1), lambda b, h: (b, 0))],
        out_specs=[pl.BlockSpec((None, None, block_h, d), lambda b, h: (b, h, 0, 0)),
                   pl.BlockSpec((None, None, block_h), lambda b, h: (b, h, 0)),
                   pl.BlockSpec((None, None, block_h), lambda b, h: (b, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((batch, hkv, block_h, d), jnp.float32),
                   jax.ShapeDtypeStruct((batch, hkv, block_h), jnp.float32),
                   jax.ShapeDtypeStruct((batch, hkv, block_h), jnp.float32)],
        config=config or GpuPagedConfig(),
        interpret=interpret,
        name="kivi_attention_gpu",
    )(q4, *leaves, page_indices.astype(jnp.int32), closed.astype(jnp.int32).reshape(batch, 1))
    return m[:, :, :group], lsum[:, :, :group], o[:, :, :group]
