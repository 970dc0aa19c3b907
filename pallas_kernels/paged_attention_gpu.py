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

from pallas_kernels import compat, gpu_common, gpu_tuning, softmax, validation
from pallas_kernels.gpu_common import GpuPagedConfig, attend_pages, check_gpu_constraints, next_pow2


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
    sliding_window: int | None,
):
    split = pl.program_id(2)
    page_size = k_ref.shape[1]
    ppp = table_ref.shape[0]
    bk = ppb * page_size
    length = length_ref[0]
    first_tok = split * ppp * page_size
    span = jnp.clip(length - first_tok, 0, ppp * page_size)
    q = q_ref[...]
    start = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)

    def body(i, carry):
        return attend_pages(
            carry, q, k_ref, v_ref, table_ref[pl.ds(i * ppb, ppb)], first_key=first_tok + i * bk,
            limit=length, visible=lambda key: (key < length) & (key >= start), masked=masked,
            sm_scale=sm_scale, soft_cap=soft_cap, start=start,
        )  # fmt: skip

    init = softmax.initial_state(q.shape[:1], q.shape[1])
    # A window's first key names this partition's first compute block that can matter (a
    # partition wholly behind it runs no iteration and leaves an empty partial).
    first = jnp.clip(start - first_tok, 0, ppp * page_size) // bk
    m, lsum, acc = lax.fori_loop(first, pl.cdiv(span, bk), body, init)
    o_ref[...] = acc
    m_out[...] = m
    l_out[...] = lsum


def paged_attention(
    q, k_pages, v_pages, lengths, page_indices, *, sm_scale=1.0, soft_cap=None,
    config: GpuPagedConfig | None = None, interpret: bool = False, sliding_window=None,
):  # fmt: skip
    """GPU-style Pallas implementation of :func:`pallas_kernels.paged_attention` (same arguments;
    ``config`` defaults to :class:`GpuPagedConfig`, ``interpret=True`` runs on CPU). A
    ``k_splits`` or ``pages_per_compute_block`` left None is chosen by
    :func:`pallas_kernels.gpu_tuning.decode_splits` from the static shape.

    Raises:
      ValueError: shapes the kernel cannot tile (see module docstring).
    """
    o, m, lsum, group = _partials(q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale,
                                  soft_cap=soft_cap, config=config, interpret=interpret,
                                  sliding_window=sliding_window)
    out = softmax.merge_partials(o, m, lsum)[:, :, :group]
    return out.reshape(q.shape).astype(q.dtype)


def paged_attention_state(
    q, k_pages, v_pages, lengths, page_indices, *, sm_scale=1.0, soft_cap=None,
    config: GpuPagedConfig | None = None, interpret: bool = False,
):  # fmt: skip
    """As :func:`paged_attention`, but returns the unnormalised online-softmax state
    ``(m f32[B, Hq], l f32[B, Hq], acc f32[B, Hq, D])`` (its split-K partials combined), which
    cascade attention merges with another key range's state."""
    o, m, lsum, group = _partials(q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale,
                                  soft_cap=soft_cap, config=config, interpret=interpret)
    m, lsum, acc = softmax.combine_states(o, m, lsum)
    return (m[:, :, :group].reshape(q.shape[:2]), lsum[:, :, :group].reshape(q.shape[:2]),
            acc[:, :, :group].reshape(q.shape))


def _partials(q, k_pages, v_pages, lengths, page_indices, *, sm_scale, soft_cap, config,
              interpret, sliding_window=None):  # fmt: skip
    """Runs the split-K kernel; returns its partial states ``o`` f32[S, B, Hkv, block_h, D],
    ``m``, ``l`` f32[S, B, Hkv, block_h] and the real rows per KV head (``G``)."""
    compat.require_triton()
    config = config or GpuPagedConfig()
    shp = validation.check_paged_attention(
        q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale, soft_cap=soft_cap
    )
    batch, hkv, d = q.shape[0], shp.num_kv_heads, shp.head_dim
    config = gpu_tuning.resolve_decode_config(
        config, batch=batch, num_kv_heads=hkv, pages_per_seq=shp.pages_per_seq,
        page_size=shp.page_size,
    )  # fmt: skip
    ppb = check_gpu_constraints(shp, config)
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
        _kernel, ppb=ppb, masked=config.masked_gather, sm_scale=float(sm_scale), soft_cap=soft_cap,
        sliding_window=sliding_window,
    )
    part = lambda b, h, s: (s, b, h, 0)
    o, m, lsum = gpu_common.pallas_call(
        kernel,
        grid=(batch, hkv, k_splits),
        in_specs=[
            pl.BlockSpec((None, None, block_h, d), lambda b, h, s: (b, h, 0, 0)),
            gpu_common.head_spec(k_pages, lambda b, h, s: h),
            gpu_common.head_spec(v_pages, lambda b, h, s: h),
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
        config=config,
        interpret=interpret,
        name="paged_attention_gpu",
    )(q4, k_pages, v_pages, table, lengths2)
    return o, m, lsum, shp.group
