"""TPU-style Pallas ragged paged attention: mixed prefill chunks, decodes and verification.

Design (see :mod:`pallas_kernels.tiling` for the row tiling):
  * ``PrefetchScalarGridSpec`` puts ``kv_lens``, the page table, ``cu_q_lens`` and ``num_seqs`` in
    SMEM. Grid ``(num_kv_heads, num_query_tiles)``; a tile is ``queries_per_block`` tokens times the
    ``G`` query heads of one KV head, so every KV page a tile needs is read once for all of them.
  * For each sequence overlapping the tile (found by binary search on ``cu_q_lens``), a
    double-buffered DMA loop (one semaphore per slot and per K/V) walks compute blocks up to the
    last key any of its rows may see (causal), copying only pages below that limit.
  * Rows of other sequences and keys past each row's causal limit are masked; padded rows (at or
    past ``cu_q_lens[num_seqs]``) match no sequence and come out zero.
  * SMEM bound: when ``max_num_seqs * pages_per_seq`` exceeds ``max_prefetch_entries`` the sequence
    slots are split into groups, one ``pallas_call`` each; a row belongs to exactly one group and is
    zero in the others, so the group outputs are summed.

Constraints: those of :mod:`pallas_kernels.tpu_common`. Compiled Mosaic behaviour is unverified
(no TPU here); TPU interpret mode is tested.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tiling, tpu_common, validation
from pallas_kernels.tpu_common import TpuPagedConfig


def _kernel(
    kv_lens_ref,  # SMEM i32[max_num_seqs]
    table_ref,  # SMEM i32[(seq_hi - seq_lo) * pages_per_seq]
    cu_ref,  # SMEM i32[max_num_seqs + 1]
    num_seqs_ref,  # SMEM i32[1]
    q_ref,  # VMEM [bq * G, D]
    *refs,  # K/V pages, output [bq * G, D], scratch: see tpu_common.paged_kernel_setup
    seq_lo: int,
    seq_hi: int,
    pages_per_seq: int,
    ppb: int,
    group: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
    h, qb = pl.program_id(0), pl.program_id(1)
    rows = q_ref.shape[0]
    block_q = rows // group
    row0 = qb * block_q
    copier, state, o_ref = tpu_common.paged_kernel_setup(table_ref, refs, head=h, ppb=ppb)
    q = q_ref[...].astype(jnp.float32)
    token = row0 + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group  # [rows, 1]
    first, last = tiling.tile_sequences(cu_ref, seq_lo, jnp.minimum(num_seqs_ref[0], seq_hi), row0,
                                 block_q)  # fmt: skip

    def visit_seq(s, carry):
        start, limit, visible = tiling.sequence_in_tile(
            cu_ref[s], cu_ref[s + 1], kv_lens_ref[s], token, row0=row0, block_q=block_q,
            max_keys=pages_per_seq * copier.page_size, sliding_window=sliding_window,
        )  # fmt: skip
        copier.attend(
            state, q, table_offset=(s - seq_lo) * pages_per_seq, limit=limit, visible=visible,
            sm_scale=sm_scale, soft_cap=soft_cap, start=start,
        )  # fmt: skip
        return carry

    lax.fori_loop(first, last, visit_seq, 0)
    state.store(o_ref)


def _call(q3, k_pages, v_pages, kv_lens, table, cu, num_seqs, *, seq_lo, seq_hi, ppb, group,
          block_q, sm_scale, soft_cap, interpret, sliding_window):  # fmt: skip
    num_kv_heads, total_rows, head_dim = q3.shape
    rows = block_q * group
    spec = pl.BlockSpec((None, rows, head_dim), lambda h, qb, *_: (h, qb, 0))
    kernel = functools.partial(
        _kernel, seq_lo=seq_lo, seq_hi=seq_hi, pages_per_seq=table.shape[1], ppb=ppb,
        group=group, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
    )  # fmt: skip
    return tpu_common.paged_pallas_call(
        kernel, num_scalar_prefetch=4, grid=(num_kv_heads, total_rows // rows), q_spec=spec,
        k_pages=k_pages, ppb=ppb, rows=rows, out_shape=jax.ShapeDtypeStruct(q3.shape, q3.dtype),
        interpret=interpret, name="ragged_paged_attention_tpu",
    )(kv_lens, table[seq_lo:seq_hi].reshape(-1), cu, num_seqs, q3, k_pages, v_pages)


def ragged_paged_attention(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=1.0,
    soft_cap=None, config: TpuPagedConfig | None = None, interpret: bool = False,
    sliding_window=None,
):  # fmt: skip
    """TPU-style Pallas implementation of :func:`pallas_kernels.ragged_paged_attention` (same
    arguments; ``config`` defaults to :class:`TpuPagedConfig`, ``interpret`` runs TPU interpret
    mode on CPU).

    Raises:
      ValueError: shapes the kernel cannot tile (see :mod:`pallas_kernels.tpu_common`).
    """
    config = config or TpuPagedConfig()
    shp = validation.check_ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    ppb = tpu_common.check_tpu_constraints(shp, q.dtype, config)
    block_q = config.queries_per_block
    q3 = tiling.tile_queries(jnp.asarray(q), shp.num_kv_heads, shp.group, block_q)
    args = (
        jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices, jnp.int32),
        jnp.asarray(cu_q_lens, jnp.int32), tiling.num_seqs_array(num_seqs),
    )  # fmt: skip
    out = None
    for lo, hi in tpu_common.prefetch_chunks(config, shp, page_indices.shape[0]):
        part = _call(
            q3, k_pages, v_pages, *args, seq_lo=lo, seq_hi=hi, ppb=ppb, group=shp.group,
            block_q=block_q, sm_scale=float(sm_scale), soft_cap=soft_cap,
            interpret=tpu_common.interpret_mode(config, interpret), sliding_window=sliding_window,
        )  # fmt: skip
        out = part if out is None else out + part
    return tiling.untile_outputs(out, q.shape[0], shp.group, shp.group).astype(q.dtype)
