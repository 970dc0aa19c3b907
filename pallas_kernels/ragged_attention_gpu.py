"""GPU-style Pallas ragged paged attention (Triton lowering; ``interpret=True`` on CPU).

Same tiling as the TPU-style kernel (:mod:`pallas_kernels.tiling`): grid
``(num_kv_heads, num_query_tiles)``, a tile = ``queries_per_block`` tokens times the query heads of
one KV head (padded to a power of two), each overlapping sequence visited once per tile with masked
page gathers, an online softmax in registers, causal masks per row. Padded rows come out zero.

Constraints: those of :mod:`pallas_kernels.gpu_common`, plus ``queries_per_block * Gp`` a power of
two >= 16 (``Gp`` = query heads per KV head rounded up to a power of two). The Triton lowering is
deprecated from JAX 0.11 (Mosaic GPU replaces it); compiled behaviour is unverified here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, gpu_common, softmax, validation
from pallas_kernels.gpu_common import GpuPagedConfig, attend_pages, check_gpu_constraints, next_pow2
from pallas_kernels.tiling import (
    num_seqs_array,
    sequence_in_tile,
    tile_queries,
    tile_sequences,
    untile_outputs,
)


def _kernel(
    q_ref,  # [bq * Gp, D]
    k_ref,  # [P, page, D] (this KV head)
    v_ref,  # [P, page, D]
    table_ref,  # i32[max_num_seqs, pages_per_seq (padded to ppb)]
    kv_lens_ref,  # i32[max_num_seqs]
    cu_ref,  # i32[max_num_seqs + 1]
    num_seqs_ref,  # i32[1]
    o_ref,  # [bq * Gp, D]
    *,
    ppb: int,
    masked: bool,
    group_padded: int,
    max_keys: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
    qb = pl.program_id(1)
    bk = ppb * k_ref.shape[1]
    q = q_ref[...]
    rows, head_dim = q.shape
    block_q = rows // group_padded
    row0 = qb * block_q
    token = row0 + (jnp.arange(rows) // group_padded)[:, None]  # [rows, 1]
    first, last = tile_sequences(cu_ref, 0, num_seqs_ref[0], row0, block_q)

    def visit_seq(s, carry):
        start, limit, visible = sequence_in_tile(
            cu_ref[s], cu_ref[s + 1], kv_lens_ref[s], token, row0=row0, block_q=block_q,
            max_keys=max_keys, sliding_window=sliding_window,
        )  # fmt: skip

        def body(i, c):
            return attend_pages(
                c, q, k_ref, v_ref, table_ref[s, pl.ds(i * ppb, ppb)], first_key=i * bk,
                limit=limit, visible=visible, masked=masked, sm_scale=sm_scale, soft_cap=soft_cap,
                start=start,
            )  # fmt: skip

        # A window's first key names the first compute block that can matter.
        return lax.fori_loop(start // bk, pl.cdiv(limit, bk), body, carry)

    init = softmax.initial_state((rows,), head_dim)
    _, lsum, acc = lax.fori_loop(first, last, visit_seq, init)
    o_ref[...] = softmax.normalize(lsum, acc).astype(o_ref.dtype)


def ragged_paged_attention(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=1.0,
    soft_cap=None, config: GpuPagedConfig | None = None, interpret: bool = False,
    sliding_window=None,
):  # fmt: skip
    """GPU-style Pallas implementation of :func:`pallas_kernels.ragged_paged_attention` (same
    arguments; ``config`` defaults to :class:`GpuPagedConfig`, whose ``k_splits`` is unused here;
    ``interpret=True`` runs on CPU).

    Raises:
      ValueError: shapes the kernel cannot tile.
    """
    compat.require_triton()
    config = config or GpuPagedConfig()
    shp = validation.check_ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    ppb = check_gpu_constraints(shp, config)
    group_padded = next_pow2(shp.group)
    block_q = max(config.queries_per_block, config.min_block_h // group_padded)
    rows = block_q * group_padded
    num_tokens, hkv, d = q.shape[0], shp.num_kv_heads, shp.head_dim
    q3 = tile_queries(jnp.asarray(q), hkv, group_padded, block_q)
    table = jnp.asarray(page_indices, jnp.int32)
    pps_pad = -(-shp.pages_per_seq // ppb) * ppb
    table = jnp.pad(table, ((0, 0), (0, pps_pad - shp.pages_per_seq)))
    kernel = functools.partial(
        _kernel, ppb=ppb, masked=config.masked_gather, group_padded=group_padded,
        max_keys=shp.pages_per_seq * shp.page_size, sm_scale=float(sm_scale), soft_cap=soft_cap,
        sliding_window=sliding_window,
    )  # fmt: skip
    full = lambda x: pl.BlockSpec(x.shape, lambda h, qb: (0,) * x.ndim)  # noqa: E731
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    cu = jnp.asarray(cu_q_lens, jnp.int32)
    n = num_seqs_array(num_seqs)
    tile = pl.BlockSpec((None, rows, d), lambda h, qb: (h, qb, 0))
    out = gpu_common.pallas_call(
        kernel,
        grid=(hkv, q3.shape[1] // rows),
        in_specs=[
            tile,
            gpu_common.head_spec(k_pages, lambda h, qb: h),
            gpu_common.head_spec(v_pages, lambda h, qb: h),
            full(table),
            full(kv_lens),
            full(cu),
            full(n),
        ],  # fmt: skip
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(q3.shape, q3.dtype),
        config=config,
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(q3, k_pages, v_pages, table, kv_lens, cu, n)
    return untile_outputs(out, num_tokens, shp.group, group_padded)
