"""TPU-style Pallas paged decode attention (Mosaic; runs on CPU in TPU interpret mode).

Design:
  * ``PrefetchScalarGridSpec``: ``lengths`` and the flattened page table sit in SMEM before the grid
    starts, so page ids are scalars the kernel can DMA with.
  * Grid ``(batch, num_kv_heads)``; one step handles all ``G = Hq / Hkv`` query heads of one KV head,
    so each KV page is read once per group.
  * Inside a step a loop walks compute blocks of ``pages_per_compute_block`` pages, double-buffered:
    block ``i+1``'s pages are DMA'd HBM -> VMEM while block ``i`` is computed. There is one DMA
    semaphore per buffer slot and per K/V. The loop stops at the last block holding a valid key, and
    only pages holding valid keys are copied at all (entries past a length are never dereferenced).
  * Online softmax state (max, sum, accumulator) lives in float32 VMEM scratch, updated by the
    step all implementations share (:mod:`pallas_kernels.softmax`).
  * SMEM is small: the page table is prefetched in batch chunks of at most
    ``max_prefetch_entries`` ints (one ``pallas_call`` per chunk).

Constraints (checked, ValueError): ``page_size`` a multiple of 8 (16 for 16-bit dtypes, the sublane
tile), ``head_dim`` a multiple of 64, the double buffers within ``vmem_limit_bytes``, and one
sequence's page table within ``max_prefetch_entries``. Compiled Mosaic behaviour is unverified here
(no TPU); interpret mode is tested.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import tpu_common, validation
from pallas_kernels.tpu_common import TpuPagedConfig


def _kernel(
    lengths_ref,  # SMEM i32[Bc]
    table_ref,  # SMEM i32[Bc * pages_per_seq]
    q_ref,  # VMEM [G, D]
    *refs,  # K/V pages, output [G, D], scratch: see tpu_common.paged_kernel_setup
    pages_per_seq: int,
    ppb: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None = None,
    with_state: bool = False,
):
    b, h = pl.program_id(0), pl.program_id(1)
    copier, state, o_ref = tpu_common.paged_kernel_setup(
        table_ref, refs, head=h, ppb=ppb, num_outputs=3 if with_state else 1
    )
    length = jnp.minimum(lengths_ref[b], pages_per_seq * copier.page_size)
    start = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    copier.attend(
        state, q_ref[...].astype(jnp.float32), table_offset=b * pages_per_seq, limit=length,
        visible=lambda key: (key < length) & (key >= start), sm_scale=sm_scale,
        soft_cap=soft_cap, start=start,
    )  # fmt: skip
    if with_state:
        state.store_state(*o_ref)
    else:
        state.store(o_ref)


def _call(q4, k_pages, v_pages, lengths, table, *, ppb, sm_scale, soft_cap, interpret,
          sliding_window=None, with_state=False):  # fmt: skip
    batch, num_kv_heads, group, head_dim = q4.shape
    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, *_: (b, h, 0, 0))
    kernel = functools.partial(
        _kernel, pages_per_seq=table.shape[1], ppb=ppb, sm_scale=sm_scale, soft_cap=soft_cap,
        with_state=with_state, sliding_window=sliding_window,
    )  # fmt: skip
    out_shape, out_specs = jax.ShapeDtypeStruct(q4.shape, q4.dtype), None
    if with_state:  # m, l f32[B, Hkv, G, 1] and acc f32[B, Hkv, G, D]
        stat_spec = pl.BlockSpec((None, None, group, 1), lambda b, h, *_: (b, h, 0, 0))
        stat = jax.ShapeDtypeStruct((*q4.shape[:3], 1), jnp.float32)
        out_shape = [stat, stat, jax.ShapeDtypeStruct(q4.shape, jnp.float32)]
        out_specs = [stat_spec, stat_spec, q_spec]
    return tpu_common.paged_pallas_call(
        kernel, num_scalar_prefetch=2, grid=(batch, num_kv_heads), q_spec=q_spec, k_pages=k_pages,
        ppb=ppb, rows=group, out_shape=out_shape, interpret=interpret, name="paged_attention_tpu",
        out_specs=out_specs,
    )(lengths, table.reshape(-1), q4, k_pages, v_pages)


def paged_attention(
    q, k_pages, v_pages, lengths, page_indices, *, sm_scale=1.0, soft_cap=None,
    config: TpuPagedConfig | None = None, interpret: bool = False, sliding_window=None,
):  # fmt: skip
    """TPU-style Pallas implementation of :func:`pallas_kernels.paged_attention` (same arguments;
    ``config`` defaults to :class:`TpuPagedConfig`, ``interpret`` runs TPU interpret mode on CPU).

    Raises:
      ValueError: shapes the kernel cannot tile (see module docstring).
    """
    out = _run(q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale, soft_cap=soft_cap,
               config=config, interpret=interpret, with_state=False,
               sliding_window=sliding_window)
    return out.reshape(q.shape)


def paged_attention_state(
    q, k_pages, v_pages, lengths, page_indices, *, sm_scale=1.0, soft_cap=None,
    config: TpuPagedConfig | None = None, interpret: bool = False,
):  # fmt: skip
    """As :func:`paged_attention`, but returns the unnormalised online-softmax state
    ``(m f32[B, Hq], l f32[B, Hq], acc f32[B, Hq, D])`` that cascade attention merges."""
    m, lsum, acc = _run(q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale,
                        soft_cap=soft_cap, config=config, interpret=interpret, with_state=True)
    return m.reshape(q.shape[:2]), lsum.reshape(q.shape[:2]), acc.reshape(q.shape)


def _run(q, k_pages, v_pages, lengths, page_indices, *, sm_scale, soft_cap, config, interpret,
         with_state, sliding_window=None):  # fmt: skip
    config = config or TpuPagedConfig()
    shp = validation.check_paged_attention(
        q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale, soft_cap=soft_cap
    )
    ppb = tpu_common.check_tpu_constraints(shp, q.dtype, config)
    batch = q.shape[0]
    q4 = jnp.asarray(q).reshape(batch, shp.num_kv_heads, shp.group, shp.head_dim)
    lengths = jnp.asarray(lengths, jnp.int32)
    table = jnp.asarray(page_indices, jnp.int32)
    kw = dict(ppb=ppb, sm_scale=float(sm_scale), soft_cap=soft_cap, with_state=with_state,
              sliding_window=sliding_window,
              interpret=tpu_common.interpret_mode(config, interpret))  # fmt: skip
    outs = [
        _call(q4[lo:hi], k_pages, v_pages, lengths[lo:hi], table[lo:hi], **kw)
        for lo, hi in tpu_common.prefetch_chunks(config, shp, batch)
    ]
    if len(outs) == 1:
        return outs[0]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outs)
