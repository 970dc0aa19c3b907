"""TPU-style Pallas states of KIVI attention over closed packed (int4 / int2) pages.

Two kernels, both ``PrefetchScalarGridSpec`` grids whose last axis walks pages: the page table
(and each sequence's closed length) sits in SMEM before the grid starts, and the ``BlockSpec``
index maps turn it into the page each grid step reads, so the pipeline DMAs one packed page
(values ``u8[page, D*bits/8]``, its float16 scales and zeros) per step, double-buffered. Steps past
a sequence's closed pages map to its last closed page (the same block: no new copy) and skip
their compute, so a page no sequence holds is never dereferenced beyond the table's first entry.
Each page is unpacked and dequantized **in the kernel, tile by tile**
(:func:`pallas_kernels.packed.dequantize_tile`, the same layout the XLA path and the GPU-style
kernel read): never a dequantized copy of the pool. The online softmax state lives in float32
VMEM scratch (:class:`pallas_kernels.tpu_common.VmemSoftmax`) and is returned unnormalised, to be
merged with the open page's state (:mod:`pallas_kernels.kivi`).

* :func:`closed_state`: one query per sequence (decode). Grid ``(batch, Hkv, pages_per_seq)``;
  a step holds the ``G`` query heads of one KV head.
* :func:`ragged_closed_state`: token rows of several sequences (prefill chunks and decodes,
  ``cu_rows``). Grid ``(Hkv, row_tiles, num_seqs, pages_per_seq)``; a tile is ``block_rows``
  rows times the ``G`` query heads; sequence ``s``'s pages are read once per tile it has rows in,
  each row seeing the keys below its own closed length (``row_len // page * page``: the
  quantize-on-fill semantics). A tile skips the compute of the other sequences and their steps
  stay on their first page (one fetch each; a grid over each tile's own sequence range would
  avoid even that).

Compiled Mosaic behaviour is unverified here (no TPU; sub-byte shifts on ``uint8`` vectors and
1-D scale blocks may need relayout there); TPU interpret mode is tested.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat, packed, tpu_common
from pallas_kernels.tpu_common import TpuPagedConfig, VmemSoftmax


def _fold_page(state: VmemSoftmax, q, refs, *, bits, key0, limit, sm_scale, soft_cap):
    """Folds one packed page (``refs``: K values / scales / zeros, V values / scales / zeros of
    the page) into ``state`` for queries ``q f32[rows, D]``; keys ``key0 + [0, page)``, each row
    seeing those below its ``limit i32[rows, 1]``."""
    kv, ks, kz, vv, vs, vz = (r[...] for r in refs)
    k = packed.dequantize_tile(kv, ks, kz, bits, "channel")  # f32[page, D]
    v = packed.dequantize_tile(vv, vs, vz, bits, "token")  # f32[page, D]
    s = tpu_common.scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap)  # [rows, page]
    key = key0 + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    state.update(s, v, key < limit)


def _page_specs(k_pages, v_pages, page_of):
    """BlockSpecs of the six leaves (one page of one KV head each); ``page_of(*grid, *prefetch)
    -> (head, page)``."""
    def spec(x):
        block = (None, None, *x.shape[2:])
        return pl.BlockSpec(block, lambda *a: (*page_of(*a), *(0,) * (x.ndim - 2)))

    leaves = (k_pages.values, k_pages.scale, k_pages.zero, v_pages.values, v_pages.scale,
              v_pages.zero)
    return leaves, [spec(x) for x in leaves]


def _call(kernel, *, grid, num_prefetch, q_spec, stat_spec, out_rows, page_specs, rows, head_dim,
          config, interpret, name):
    stat = jax.ShapeDtypeStruct((*out_rows, 1), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_prefetch, grid=grid,
            in_specs=[q_spec, *page_specs],
            out_specs=[stat_spec, stat_spec, q_spec],
            scratch_shapes=tpu_common.softmax_scratch(rows, head_dim)),
        out_shape=[stat, stat, jax.ShapeDtypeStruct((*out_rows, head_dim), jnp.float32)],
        compiler_params=compat.tpu_compiler_params(
            dimension_semantics=("parallel",) + ("arbitrary",) * (len(grid) - 1)),
        interpret=tpu_common.interpret_mode(config or TpuPagedConfig(), interpret),
        name=name,
    )


# ----------------------------------------------------------------------------- decode


def _decode_kernel(closed_ref, table_ref, q_ref, *refs, bits, page, sm_scale, soft_cap):
    # closed_ref SMEM i32[B]; table_ref SMEM i32[B * pps]; q_ref VMEM f32[G, D]; refs: the six
    # page tiles, outputs m/l f32[G, 1] and acc f32[G, D], scratch m/l/acc
    b, i = pl.program_id(0), pl.program_id(2)
    m_out, l_out, acc_out = refs[6:9]
    state = VmemSoftmax(*refs[9:12])

    @pl.when(i == 0)
    def _():
        state.reset()

    @pl.when(i * page < closed_ref[b])
    def _():
        _fold_page(state, q_ref[...], refs[:6], bits=bits, key0=i * page,
                   limit=closed_ref[b], sm_scale=sm_scale, soft_cap=soft_cap)

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        state.store_state(m_out, l_out, acc_out)


def closed_state(
    qg: jax.Array,  # f32[B, Hkv, G, D]
    k_pages: packed.PackedPages,  # values u8[Hkv, P, page, D*bits/8], scale/zero f16[Hkv, P, D]
    v_pages: packed.PackedPages,  # values u8[Hkv, P, page, D*bits/8], scale/zero [Hkv, P, page]
    closed: jax.Array,  # i32[B] closed tokens per sequence (a multiple of page)
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    *,
    sm_scale: float,
    soft_cap: float | None,
    interpret: bool,
    config: TpuPagedConfig | None = None,
):  # -> (m f32[B, Hkv, G], l f32[B, Hkv, G], acc f32[B, Hkv, G, D])
    """The online-softmax state of each query over its closed packed pages (module docstring)."""
    batch, hkv, group, d = qg.shape
    page = k_pages.values.shape[-2]
    pps = page_indices.shape[1]

    def page_of(b, h, i, closed_ref, table_ref):
        last = jnp.maximum(closed_ref[b] // page - 1, 0)
        return h, table_ref[b * pps + jnp.minimum(i, last)]

    leaves, specs = _page_specs(k_pages, v_pages, page_of)
    q_spec = pl.BlockSpec((None, None, group, d), lambda b, h, i, *_: (b, h, 0, 0))
    stat_spec = pl.BlockSpec((None, None, group, 1), lambda b, h, i, *_: (b, h, 0, 0))
    kernel = functools.partial(_decode_kernel, bits=k_pages.bits, page=page,
                               sm_scale=float(sm_scale), soft_cap=soft_cap)
    m, lsum, acc = _call(kernel, grid=(batch, hkv, pps), num_prefetch=2, q_spec=q_spec,
                         stat_spec=stat_spec, out_rows=(batch, hkv, group),
                         page_specs=specs, rows=group, head_dim=d, config=config,
                         interpret=interpret, name="kivi_attention_tpu")(
        closed.astype(jnp.int32), page_indices.astype(jnp.int32).reshape(-1), qg, *leaves)
    return m[..., 0], lsum[..., 0], acc


# ----------------------------------------------------------------------------- ragged rows


def _ragged_kernel(pages_ref, table_ref, cu_ref, q_ref, *refs, bits, page, block_rows, group,
                   sm_scale, soft_cap):
    # pages_ref SMEM i32[S] closed pages per sequence; table_ref SMEM i32[S * pps]; cu_ref SMEM
    # i32[S + 1] rows of each sequence; q_ref VMEM f32[R, D] (R = block_rows * G); refs: the six
    # page tiles, row_len / row_seq i32[R, 1], outputs m/l f32[R, 1], acc f32[R, D], scratch
    qb, s, i = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    len_ref, seq_ref = refs[6:8]
    m_out, l_out, acc_out = refs[8:11]
    state = VmemSoftmax(*refs[11:14])

    @pl.when((s == 0) & (i == 0))
    def _():
        state.reset()

    lo, hi = qb * block_rows, (qb + 1) * block_rows
    in_tile = (cu_ref[s] < hi) & (cu_ref[s + 1] > lo)

    @pl.when(in_tile & (i < pages_ref[s]))
    def _():
        mine = seq_ref[...] == s  # [R, 1]: this sequence's rows
        limit = jnp.where(mine, len_ref[...] // page * page, 0)
        _fold_page(state, q_ref[...], refs[:6], bits=bits, key0=i * page, limit=limit,
                   sm_scale=sm_scale, soft_cap=soft_cap)

    @pl.when((s == pl.num_programs(2) - 1) & (i == pl.num_programs(3) - 1))
    def _():
        state.store_state(m_out, l_out, acc_out)


def ragged_closed_state(
    q: jax.Array,  # [T, Hq, D] token rows, sequence by sequence (cu_rows)
    k_pages: packed.PackedPages,  # values u8[Hkv, P, page, D*bits/8], scale/zero f16[Hkv, P, D]
    v_pages: packed.PackedPages,  # values u8[Hkv, P, page, D*bits/8], scale/zero [Hkv, P, page]
    row_len: jax.Array,  # i32[T] keys each row attends to (0: padding)
    row_seq: jax.Array,  # i32[T] the row's sequence
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_rows: jax.Array,  # i32[S + 1] rows of sequence s: [cu_rows[s], cu_rows[s + 1])
    *,
    sm_scale: float,
    soft_cap: float | None,
    interpret: bool,
    block_rows: int = 8,
    config: TpuPagedConfig | None = None,
):  # -> (m f32[T, Hkv, G], l f32[T, Hkv, G], acc f32[T, Hkv, G, D])
    """The online-softmax state of each token row over its closed packed pages (module
    docstring); rows of sequence ``s`` must lie in ``[cu_rows[s], cu_rows[s + 1])`` (padding
    rows: ``row_len`` 0)."""
    t, hq, d = q.shape
    hkv, _, page = k_pages.values.shape[:3]
    group = hq // hkv
    num_seqs, pps = page_indices.shape
    tiles = -(-t // block_rows)
    pad = tiles * block_rows - t
    rows = block_rows * group
    qh = jnp.pad(q.astype(jnp.float32).reshape(t, hkv, group, d), ((0, pad), (0, 0), (0, 0),
                                                                    (0, 0)))
    qh = jnp.swapaxes(qh, 0, 1).reshape(hkv, (t + pad) * group, d)  # row-major, heads minor
    per_row = lambda x: jnp.repeat(jnp.pad(x.astype(jnp.int32), (0, pad)), group)[:, None]
    row_len, row_seq = per_row(row_len), per_row(row_seq)  # i32[(T + pad) * G, 1]
    # closed pages a sequence's rows read at most: its last row's
    last_row = jnp.clip(cu_rows[1:] - 1, 0, t - 1)
    npages = jnp.where(cu_rows[1:] > cu_rows[:-1], row_len[last_row * group, 0] // page, 0)

    def page_of(h, qb, s, i, pages_ref, table_ref, cu_ref):
        # a sequence outside the tile stays on its first page: one fetch, not its pages
        in_tile = (cu_ref[s] < (qb + 1) * block_rows) & (cu_ref[s + 1] > qb * block_rows)
        i = jnp.where(in_tile, jnp.minimum(i, jnp.maximum(pages_ref[s] - 1, 0)), 0)
        return h, table_ref[s * pps + i]

    leaves, specs = _page_specs(k_pages, v_pages, page_of)
    q_spec = pl.BlockSpec((None, rows, d), lambda h, qb, s, i, *_: (h, qb, 0))
    stat_spec = pl.BlockSpec((None, rows, 1), lambda h, qb, s, i, *_: (h, qb, 0))
    row_spec = pl.BlockSpec((rows, 1), lambda h, qb, s, i, *_: (qb, 0))
    kernel = functools.partial(_ragged_kernel, bits=k_pages.bits, page=page,
                               block_rows=block_rows, group=group, sm_scale=float(sm_scale),
                               soft_cap=soft_cap)
    call = _call(kernel, grid=(hkv, tiles, num_seqs, pps), num_prefetch=3, q_spec=q_spec,
                 stat_spec=stat_spec, out_rows=(hkv, (t + pad) * group),
                 page_specs=[*specs, row_spec, row_spec], rows=rows, head_dim=d,
                 config=config, interpret=interpret, name="kivi_ragged_attention_tpu")
    m, lsum, acc = call(npages.astype(jnp.int32), page_indices.astype(jnp.int32).reshape(-1),
                        cu_rows.astype(jnp.int32), qh, *leaves, row_len, row_seq)
    back = lambda x: jnp.swapaxes(x.reshape(hkv, t + pad, group, -1)[:, :t], 0, 1)
    return back(m)[..., 0], back(lsum)[..., 0], back(acc)
