"""GPU-style Pallas paged decode attention: split-K flash-decoding (Triton lowering).

Design:
  * Grid ``(batch, num_kv_heads, k_splits)``: the page list of each sequence is cut into
    ``k_splits`` partitions that run in parallel (a decode batch alone cannot fill a GPU); each
    program loops over compute blocks of its partition with an online softmax and writes an
    unnormalised partial output plus its running max and sum. A jnp epilogue merges the partials.
  * All ``G`` query heads of a KV head are one ``[block_h, D]`` tile (padded to ``block_h >= 16``
    rows, the smallest Triton ``dot``), so each page is read once per group.
  * Pages are gathered with a *masked* load: lanes past the sequence's length are never
    dereferenced (their page-table entries may be garbage), so no position past a length is read.

Constraints (checked, ValueError): ``page_size`` and ``head_dim`` powers of two (Triton block
shapes), ``page_size`` in [8, 256], ``head_dim >= 16``. The Triton lowering is deprecated from JAX
0.11 in favour of Mosaic GPU; only :mod:`pallas_kernels.api` names this module. Compiled behaviour
is unverified here (no GPU); ``interpret=True`` is tested on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, validation
from pallas_kernels.gpu_common import (
    GpuPagedConfig,
    check_gpu_constraints,
    dot,
    load_pages,
    merge_partials,
    next_pow2,
    online_update,
)


def _kernel(
    q_ref,  # [block_h, D]
    k_ref,  # [P, page, D] (this KV head)
    v_ref,  # [P, page, D]
    table_ref,  # i32[pages_per_partition]
    length_ref,  # i32[1]
    o_ref,  # f32[block_h, D] unnormalised partial
    m_out,  # f32[block_h]
    l_out,  # f32[block_h]
    *,
    ppb: int,
    masked: bool,
    sm_scale: float,
    soft_cap: float | None,
):
    split = pl.program_id(2)
    page_size = k_ref.shape[1]
    ppp = table_ref.shape[0]
    bk = ppb * page_size
    length = length_ref[0]
    first_tok = split * ppp * page_size
    span = jnp.clip(length - first_tok, 0, ppp * page_size)
    q = q_ref[...]
    block_h, head_dim = q.shape

    def body(i, carry):
        ids = table_ref[pl.ds(i * ppb, ppb)]
        page_start = first_tok + (i * ppb + jnp.arange(ppb)) * page_size
        k = load_pages(k_ref, ids, page_start < length, dtype=q.dtype, masked=masked)
        v = load_pages(v_ref, ids, page_start < length, dtype=q.dtype, masked=masked)
        pos = first_tok + i * bk + jnp.arange(bk)
        v = jnp.where((pos < length)[:, None], v, jnp.zeros_like(v))
        s = dot(q, k, trans_b=True) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        return online_update(carry, s, v, (pos < length)[None, :])

    init = (
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        jnp.zeros((block_h, head_dim), jnp.float32),
    )
    m, lsum, acc = lax.fori_loop(0, pl.cdiv(span, bk), body, init)
    o_ref[...] = acc
    m_out[...] = m
    l_out[...] = lsum


def paged_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, page, D]
    v_pages: jax.Array,  # [Hkv, P, page, D]
    lengths: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    *,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    config: GpuPagedConfig | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, Hq, D]
    """GPU-style Pallas implementation of :func:`pallas_kernels.paged_attention`.

    Args:
      q, k_pages, v_pages, lengths, page_indices, sm_scale, soft_cap: as in the public op.
      config: tuning knobs (default :class:`GpuPagedConfig`).
      interpret: run with ``interpret=True`` on CPU.

    Raises:
      ValueError: shapes the kernel cannot tile (see module docstring).
    """
    compat.require_triton()
    config = config or GpuPagedConfig()
    shp = validation.check_paged_attention(
        q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale, soft_cap=soft_cap
    )
    ppb = check_gpu_constraints(shp, config)
    batch, hkv, d = q.shape[0], shp.num_kv_heads, shp.head_dim
    k_splits = min(config.k_splits, next_pow2(-(-shp.pages_per_seq // ppb)))
    ppp = ppb * next_pow2(-(-shp.pages_per_seq // (k_splits * ppb)))
    table = jnp.asarray(page_indices, jnp.int32)
    table = jnp.pad(table, ((0, 0), (0, k_splits * ppp - shp.pages_per_seq)))
    table = table.reshape(batch, k_splits, ppp)
    block_h = max(config.min_block_h, next_pow2(shp.group))
    q4 = jnp.asarray(q).reshape(batch, hkv, shp.group, d)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, block_h - shp.group), (0, 0)))
    lengths2 = jnp.asarray(lengths, jnp.int32).reshape(batch, 1)
    kernel = functools.partial(
        _kernel, ppb=ppb, masked=config.masked_gather, sm_scale=float(sm_scale), soft_cap=soft_cap
    )
    part = lambda b, h, s: (s, b, h, 0)
    o, m, lsum = pl.pallas_call(
        kernel,
        grid=(batch, hkv, k_splits),
        in_specs=[
            pl.BlockSpec((None, None, block_h, d), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, *k_pages.shape[1:]), lambda b, h, s: (h, 0, 0, 0)),
            pl.BlockSpec((None, *v_pages.shape[1:]), lambda b, h, s: (h, 0, 0, 0)),
            pl.BlockSpec((None, None, ppp), lambda b, h, s: (b, s, 0)),
            pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, d), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, block_h), part),
            pl.BlockSpec((None, None, None, block_h), part),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((k_splits, batch, hkv, block_h, d), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, batch, hkv, block_h), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, batch, hkv, block_h), jnp.float32),
        ],
        compiler_params=compat.gpu_compiler_params(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="paged_attention_gpu",
    )(q4, k_pages, v_pages, table, lengths2)
    out = merge_partials(o, m, lsum)[:, :, : shp.group]
    return out.reshape(q.shape).astype(q.dtype)
