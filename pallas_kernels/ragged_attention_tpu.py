"""TPU-style Pallas ragged paged attention: mixed prefill chunks, decodes and verification.

Design (see :mod:`pallas_kernels.ragged_common` for the row tiling):
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
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat, validation
from pallas_kernels.ragged_common import lower_bound, num_seqs_array, tile_queries, untile_outputs
from pallas_kernels.tpu_common import (
    PageBlockCopier,
    TpuPagedConfig,
    check_tpu_constraints,
    online_softmax_update,
    scores,
)


def _kernel(
    kv_lens_ref,  # SMEM i32[max_num_seqs]
    table_ref,  # SMEM i32[(seq_hi - seq_lo) * pages_per_seq]
    cu_ref,  # SMEM i32[max_num_seqs + 1]
    num_seqs_ref,  # SMEM i32[1]
    q_ref,  # VMEM [bq * G, D]
    k_hbm,  # ANY [Hkv, P, page, D]
    v_hbm,  # ANY [Hkv, P, page, D]
    o_ref,  # VMEM [bq * G, D]
    k_buf,  # VMEM [2, ppb, page, D]
    v_buf,  # VMEM [2, ppb, page, D]
    sems,  # DMA [2 (K/V), 2 (slot)]
    m_ref,  # VMEM f32[bq * G, 1]
    l_ref,  # VMEM f32[bq * G, 1]
    acc_ref,  # VMEM f32[bq * G, D]
    *,
    seq_lo: int,
    seq_hi: int,
    pages_per_seq: int,
    ppb: int,
    group: int,
    sm_scale: float,
    soft_cap: float | None,
):
    h, qb = pl.program_id(0), pl.program_id(1)
    page_size, head_dim = k_buf.shape[2], k_buf.shape[3]
    rows = q_ref.shape[0]
    block_q = rows // group
    bk = ppb * page_size
    row0 = qb * block_q
    copier = PageBlockCopier(table_ref, k_hbm, v_hbm, k_buf, v_buf, sems, head=h, ppb=ppb)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    q = q_ref[...].astype(jnp.float32)
    token = row0 + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group  # [rows, 1]

    hi = jnp.minimum(num_seqs_ref[0], seq_hi)
    first = lower_bound(seq_lo, hi, lambda s: cu_ref[s + 1] <= row0)
    last = lower_bound(first, hi, lambda s: cu_ref[s] < row0 + block_q)

    def visit_seq(s, carry):
        q_start, q_end = cu_ref[s], cu_ref[s + 1]
        kv_len = kv_lens_ref[s]
        # Keys the tile's last row of this sequence may see (causal), within the page table.
        tile_end = jnp.minimum(q_end, row0 + block_q)
        limit = jnp.clip(kv_len - q_end + tile_end, 0, pages_per_seq * page_size)
        limit = jnp.where(tile_end > jnp.maximum(q_start, row0), limit, 0)
        num_pages = pl.cdiv(limit, page_size)
        num_blocks = pl.cdiv(limit, bk)
        offset = (s - seq_lo) * pages_per_seq
        row_ok = (token >= q_start) & (token < q_end)
        row_limit = kv_len - q_end + token + 1  # [rows, 1]

        @pl.when(num_blocks > 0)
        def _():
            copier.start(offset, 0, num_pages, 0)

        def body(i, c):
            slot = i % 2

            @pl.when(i + 1 < num_blocks)
            def _():
                copier.start(offset, (i + 1) * ppb, num_pages, 1 - slot)

            copier.wait(offset, i * ppb, num_pages, slot)
            k = k_buf[slot].astype(jnp.float32).reshape(bk, head_dim)
            v = v_buf[slot].astype(jnp.float32).reshape(bk, head_dim)
            v = jnp.where(i * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < limit, v, 0.0)
            key = i * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            s_ = scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap)
            online_softmax_update(m_ref, l_ref, acc_ref, s_, v, row_ok & (key < row_limit))
            return c

        lax.fori_loop(0, num_blocks, body, 0)
        return carry

    lax.fori_loop(first, last, visit_seq, 0)
    denom = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def _call(q3, k_pages, v_pages, kv_lens, table, cu, num_seqs, *, seq_lo, seq_hi, ppb, group,
          block_q, sm_scale, soft_cap, interpret):  # fmt: skip
    num_kv_heads, total_rows, head_dim = q3.shape
    page_size = k_pages.shape[2]
    rows = block_q * group
    spec = pl.BlockSpec((None, rows, head_dim), lambda h, qb, *_: (h, qb, 0))
    kernel = functools.partial(
        _kernel, seq_lo=seq_lo, seq_hi=seq_hi, pages_per_seq=table.shape[1], ppb=ppb,
        group=group, sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    any_spec = pl.BlockSpec(memory_space=compat.any_memory_space())
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_kv_heads, total_rows // rows),
            in_specs=[spec, any_spec, any_spec],
            out_specs=spec,
            scratch_shapes=[
                pltpu.VMEM((2, ppb, page_size, head_dim), k_pages.dtype),
                pltpu.VMEM((2, ppb, page_size, head_dim), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q3.shape, q3.dtype),
        compiler_params=compat.tpu_compiler_params(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(kv_lens, table[seq_lo:seq_hi].reshape(-1), cu, num_seqs, q3, k_pages, v_pages)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, page, D]
    v_pages: jax.Array,  # [Hkv, P, page, D]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1] | int
    *,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    config: TpuPagedConfig | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """TPU-style Pallas implementation of :func:`pallas_kernels.ragged_paged_attention`.

    Args:
      q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, soft_cap: as in
        the public op.
      config: tuning knobs (default :class:`TpuPagedConfig`).
      interpret: run in TPU interpret mode on CPU.

    Raises:
      ValueError: shapes the kernel cannot tile (see :mod:`pallas_kernels.tpu_common`).
    """
    config = config or TpuPagedConfig()
    shp = validation.check_ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    ppb = check_tpu_constraints(shp, q.dtype, config)
    num_tokens = q.shape[0]
    block_q = config.queries_per_block
    q3 = tile_queries(jnp.asarray(q), shp.num_kv_heads, shp.group, block_q)
    max_num_seqs = page_indices.shape[0]
    table = jnp.asarray(page_indices, jnp.int32)
    args = (
        jnp.asarray(kv_lens, jnp.int32), table, jnp.asarray(cu_q_lens, jnp.int32),
        num_seqs_array(num_seqs),
    )  # fmt: skip
    mode = (
        compat.tpu_interpret_params(
            strict=config.strict_interpret, num_cores=config.interpret_cores
        )
        if interpret
        else False
    )
    chunk = max(1, config.max_prefetch_entries // shp.pages_per_seq)
    out = None
    for lo in range(0, max_num_seqs, chunk):
        part = _call(
            q3, k_pages, v_pages, *args, seq_lo=lo, seq_hi=min(lo + chunk, max_num_seqs),
            ppb=ppb, group=shp.group, block_q=block_q, sm_scale=float(sm_scale),
            soft_cap=soft_cap, interpret=mode,
        )  # fmt: skip
        out = part if out is None else out + part
    return untile_outputs(out, num_tokens, shp.group, shp.group).astype(q.dtype)
