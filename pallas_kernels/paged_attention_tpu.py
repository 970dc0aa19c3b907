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
  * Online softmax state (max, sum, accumulator) lives in float32 VMEM scratch.
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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat, validation
from pallas_kernels.tpu_common import (
    PageBlockCopier,
    TpuPagedConfig,
    check_tpu_constraints,
    online_softmax_update,
    scores,
)


def _kernel(
    lengths_ref,  # SMEM i32[Bc]
    table_ref,  # SMEM i32[Bc * pages_per_seq]
    q_ref,  # VMEM [G, D]
    k_hbm,  # ANY [Hkv, P, page, D]
    v_hbm,  # ANY [Hkv, P, page, D]
    o_ref,  # VMEM [G, D]
    k_buf,  # VMEM [2, ppb, page, D]
    v_buf,  # VMEM [2, ppb, page, D]
    sems,  # DMA [2 (K/V), 2 (slot)]
    m_ref,  # VMEM f32[G, 1]
    l_ref,  # VMEM f32[G, 1]
    acc_ref,  # VMEM f32[G, D]
    *,
    pages_per_seq: int,
    ppb: int,
    sm_scale: float,
    soft_cap: float | None,
):
    b, h = pl.program_id(0), pl.program_id(1)
    page_size, head_dim = k_buf.shape[2], k_buf.shape[3]
    bk = ppb * page_size
    length = jnp.minimum(lengths_ref[b], pages_per_seq * page_size)
    num_pages = pl.cdiv(length, page_size)
    num_blocks = pl.cdiv(length, bk)
    offset = b * pages_per_seq
    copier = PageBlockCopier(table_ref, k_hbm, v_hbm, k_buf, v_buf, sems, head=h, ppb=ppb)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(num_blocks > 0)
    def _():
        copier.start(offset, 0, num_pages, 0)

    q = q_ref[...].astype(jnp.float32)

    def body(i, carry):
        slot = i % 2

        @pl.when(i + 1 < num_blocks)
        def _():
            copier.start(offset, (i + 1) * ppb, num_pages, 1 - slot)

        copier.wait(offset, i * ppb, num_pages, slot)
        k = k_buf[slot].astype(jnp.float32).reshape(bk, head_dim)  # reshape values, not refs
        v = v_buf[slot].astype(jnp.float32).reshape(bk, head_dim)
        pos = i * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        v = jnp.where(pos < length, v, 0.0)  # stale / NaN rows past the length
        s = scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap)
        valid = (i * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)) < length
        online_softmax_update(m_ref, l_ref, acc_ref, s, v, valid)
        return carry

    lax.fori_loop(0, num_blocks, body, 0)
    denom = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def _call(q4, k_pages, v_pages, lengths, table, *, ppb, sm_scale, soft_cap, interpret):
    batch, num_kv_heads, group, head_dim = q4.shape
    _, _, page_size, _ = k_pages.shape
    pages_per_seq = table.shape[1]
    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, *_: (b, h, 0, 0))
    kernel = functools.partial(
        _kernel, pages_per_seq=pages_per_seq, ppb=ppb, sm_scale=sm_scale, soft_cap=soft_cap
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, num_kv_heads),
            in_specs=[
                q_spec,
                pl.BlockSpec(memory_space=compat.any_memory_space()),
                pl.BlockSpec(memory_space=compat.any_memory_space()),
            ],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, ppb, page_size, head_dim), k_pages.dtype),
                pltpu.VMEM((2, ppb, page_size, head_dim), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((group, 1), jnp.float32),
                pltpu.VMEM((group, 1), jnp.float32),
                pltpu.VMEM((group, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q4.shape, q4.dtype),
        compiler_params=compat.tpu_compiler_params(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="paged_attention_tpu",
    )(lengths, table.reshape(-1), q4, k_pages, v_pages)


def paged_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, page, D]
    v_pages: jax.Array,  # [Hkv, P, page, D]
    lengths: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    *,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    config: TpuPagedConfig | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, Hq, D]
    """TPU-style Pallas implementation of :func:`pallas_kernels.paged_attention`.

    Args:
      q, k_pages, v_pages, lengths, page_indices, sm_scale, soft_cap: as in the public op.
      config: tuning knobs (default :class:`TpuPagedConfig`).
      interpret: run in TPU interpret mode on CPU.

    Raises:
      ValueError: shapes the kernel cannot tile (see module docstring).
    """
    config = config or TpuPagedConfig()
    shp = validation.check_paged_attention(
        q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale, soft_cap=soft_cap
    )
    ppb = check_tpu_constraints(shp, q.dtype, config)
    batch = q.shape[0]
    q4 = jnp.asarray(q).reshape(batch, shp.num_kv_heads, shp.group, shp.head_dim)
    lengths = jnp.asarray(lengths, jnp.int32)
    table = jnp.asarray(page_indices, jnp.int32)
    mode = (
        compat.tpu_interpret_params(
            strict=config.strict_interpret, num_cores=config.interpret_cores
        )
        if interpret
        else False
    )
    chunk = max(1, config.max_prefetch_entries // shp.pages_per_seq)
    outs = [
        _call(
            q4[lo : lo + chunk],
            k_pages,
            v_pages,
            lengths[lo : lo + chunk],
            table[lo : lo + chunk],
            ppb=ppb,
            sm_scale=float(sm_scale),
            soft_cap=soft_cap,
            interpret=mode,
        )  # fmt: skip
        for lo in range(0, batch, chunk)
    ]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return out.reshape(q.shape)
