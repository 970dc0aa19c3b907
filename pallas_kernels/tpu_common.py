"""Pieces shared by the TPU-style (Mosaic) kernels: config, constraints, page DMA loop, VMEM state.

Constraints (checked, ValueError): ``page_size`` a multiple of 8 (16 for 16-bit dtypes, the sublane
tile) in [8, 256], ``head_dim`` a multiple of 64, the K/V double buffers within
``vmem_limit_bytes``, one sequence's page table within ``max_prefetch_entries`` (SMEM).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat, quant, softmax, validation


@dataclasses.dataclass(frozen=True)
class TpuPagedConfig:
    """Tuning knobs of the TPU-style paged kernels.

    Attributes:
      pages_per_compute_block: pages DMA'd and computed per loop step (clipped to pages_per_seq).
      max_prefetch_entries: most page-table ints prefetched to SMEM per ``pallas_call``.
      vmem_limit_bytes: budget for the K/V double buffers plus scratch.
      queries_per_block: query tokens per grid step of the ragged kernel (a multiple of 8).
      strict_interpret: in interpret mode, detect races, raise on OOB reads, NaN-fill scratch.
      interpret_cores: simulated TensorCores in interpret mode; the grid's first ("parallel")
        axis is spread over them, which checks that grid steps share no state (megacore).
    """

    pages_per_compute_block: int = 8
    queries_per_block: int = 16
    max_prefetch_entries: int = 16384
    vmem_limit_bytes: int = 16 * 1024 * 1024
    strict_interpret: bool = True
    interpret_cores: int = 1

    def __post_init__(self):
        names = ("pages_per_compute_block", "max_prefetch_entries", "vmem_limit_bytes")
        names += ("interpret_cores",)
        for name in names + ("queries_per_block",):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.queries_per_block % 8:
            raise ValueError(f"queries_per_block={self.queries_per_block} must be a multiple of 8")


def check_tpu_constraints(shp: validation.PagedShape, dtype, config: TpuPagedConfig) -> int:
    """Validates what the TPU-style kernels can tile; returns the pages per compute block."""
    itemsize = jnp.dtype(dtype).itemsize
    sublanes = 8 * (4 // itemsize)
    page_size, head_dim = shp.page_size, shp.head_dim
    if page_size % sublanes or not 8 <= page_size <= 256:
        raise ValueError(
            f"{page_size=} must be a multiple of {sublanes} in [8, 256] for the TPU-style kernel "
            f"with {jnp.dtype(dtype).name} (sublane tiling)"
        )
    if head_dim % 64:
        raise ValueError(f"{head_dim=} must be a multiple of 64 for the TPU-style kernel")
    ppb = min(config.pages_per_compute_block, shp.pages_per_seq)
    buffers = 2 * 2 * ppb * page_size * head_dim * itemsize  # K and V, two slots each
    if buffers > config.vmem_limit_bytes:
        raise ValueError(
            f"K/V double buffers need {buffers} bytes > vmem_limit_bytes="
            f"{config.vmem_limit_bytes}; lower pages_per_compute_block={ppb}"
        )
    if shp.pages_per_seq > config.max_prefetch_entries:
        raise ValueError(
            f"pages_per_seq={shp.pages_per_seq} exceeds max_prefetch_entries="
            f"{config.max_prefetch_entries}: one sequence's page table must fit in SMEM"
        )
    return ppb


def interpret_mode(config, interpret: bool):
    """The ``interpret=`` value of a TPU-style ``pallas_call``: False (compiled) or the
    interpreter's parameters (strict checks per ``config.strict_interpret``)."""
    if not interpret:
        return False
    return compat.tpu_interpret_params(
        strict=config.strict_interpret, num_cores=getattr(config, "interpret_cores", 1)
    )


def prefetch_chunks(config: TpuPagedConfig, shp: validation.PagedShape, rows: int):
    """``(lo, hi)`` ranges of page-table rows whose tables fit ``max_prefetch_entries`` (SMEM)."""
    chunk = max(1, config.max_prefetch_entries // shp.pages_per_seq)
    return [(lo, min(lo + chunk, rows)) for lo in range(0, rows, chunk)]


def paged_pallas_call(kernel, *, num_scalar_prefetch, grid, q_spec, k_pages, ppb, rows, out_shape,
                      interpret, name, out_specs=None):  # fmt: skip
    """``pl.pallas_call`` of a paged kernel: scalar-prefetch grid ``grid`` (first axis parallel),
    a query block ``q_spec`` of ``rows`` rows (the output's block too, unless ``out_specs`` says
    otherwise), K/V pages left in HBM for the kernel's own DMAs, and the scratch
    :func:`paged_kernel_setup` unpacks."""
    _, _, page_size, head_dim = k_pages.shape
    any_spec = pl.BlockSpec(memory_space=compat.any_memory_space())
    values, scales = quant.split(k_pages)
    scratch = [
        pltpu.VMEM((2, ppb, page_size, head_dim), values.dtype),
        pltpu.VMEM((2, ppb, page_size, head_dim), values.dtype),
        pltpu.SemaphoreType.DMA((2 if scales is None else 4, 2)),
        *softmax_scratch(rows, head_dim),
    ]
    if scales is not None:  # quantized: the scales of each page DMA'd beside its values
        scratch += [pltpu.VMEM((2, ppb, scales.shape[-1]), scales.dtype)] * 2
    # A QuantizedPages argument gets a QuantizedPages of specs (its values and scales stay in HBM).
    any_spec_of = lambda x: jax.tree.map(lambda _: any_spec, x)  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalar_prefetch, grid=grid,
            in_specs=[q_spec, any_spec_of(k_pages), any_spec_of(k_pages)],
            out_specs=out_specs or q_spec,
            scratch_shapes=scratch,
        ),  # fmt: skip
        out_shape=out_shape,
        compiler_params=compat.tpu_compiler_params(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name=name,
    )


def softmax_scratch(rows: int, head_dim: int) -> list:
    """VMEM for :class:`VmemSoftmax`: ``m`` and ``l`` f32[rows, 1], ``acc`` f32[rows, D]."""
    return [
        pltpu.VMEM((rows, 1), jnp.float32),
        pltpu.VMEM((rows, 1), jnp.float32),
        pltpu.VMEM((rows, head_dim), jnp.float32),
    ]


def paged_kernel_setup(table_ref, refs, *, head, ppb, num_outputs=1):
    """Unpacks the refs a paged kernel takes after its query block; returns
    ``(copier, state, o_ref)``, the state reset (``o_ref`` is a tuple of ``num_outputs`` refs
    when that is not 1).

    ``refs``: ``k_hbm``, ``v_hbm`` (ANY ``[Hkv, P, page, D]``), ``o_ref`` (VMEM ``[rows, D]``),
    then the scratch :func:`paged_pallas_call` allocates: ``k_buf``, ``v_buf`` (VMEM
    ``[2, ppb, page, D]``), ``sems`` (DMA ``[2 (K/V), 2 (slot)]``), ``m``, ``l`` (f32
    ``[rows, 1]``) and ``acc`` (f32 ``[rows, D]``); for quantized pages (``k_hbm`` / ``v_hbm``
    each a ``QuantizedPages`` of refs) the scales' buffers ``ks_buf``, ``vs_buf`` (VMEM
    ``[2, ppb, S]``) follow and ``sems`` is ``[4, 2]``.
    """
    k_hbm, v_hbm = refs[:2]
    outs = refs[2:2 + num_outputs]
    k_buf, v_buf, sems, m_ref, l_ref, acc_ref, *scale_bufs = refs[2 + num_outputs:]
    copier = PageBlockCopier(table_ref, k_hbm, v_hbm, k_buf, v_buf, sems, head=head, ppb=ppb,
                             scale_bufs=scale_bufs)
    state = VmemSoftmax(m_ref, l_ref, acc_ref)
    state.reset()
    return copier, state, outs[0] if num_outputs == 1 else outs


class VmemSoftmax:
    """The online-softmax state of a tile in VMEM scratch (``m``/``l`` ``[rows, 1]``, ``acc``
    ``[rows, D]``), updated by :func:`pallas_kernels.softmax.online_softmax_step`."""

    def __init__(self, m_ref, l_ref, acc_ref):
        self.refs = (m_ref, l_ref, acc_ref)

    def reset(self):
        m_ref, _, acc_ref = self.refs
        init = softmax.initial_state(m_ref.shape[:1], acc_ref.shape[1], keepdims=True)
        for ref, x in zip(self.refs, init):
            ref[...] = x

    def update(self, s, v, valid):
        """Folds scores ``s`` f32[rows, bk] and values ``v`` f32[bk, D] (masked rows zeroed)."""
        state = softmax.online_softmax_step(
            tuple(ref[...] for ref in self.refs), s, v, valid,
            pv=lambda p, v: jnp.dot(p, v, preferred_element_type=jnp.float32),
        )  # fmt: skip
        for ref, x in zip(self.refs, state):
            ref[...] = x

    def store(self, o_ref):
        """Writes the normalised output."""
        _, l_ref, acc_ref = self.refs
        o_ref[...] = softmax.normalize(l_ref[...], acc_ref[...]).astype(o_ref.dtype)

    def store_state(self, m_out, l_out, acc_out):
        """Writes the unnormalised state (``m``/``l`` f32[rows, 1], ``acc`` f32[rows, D])."""
        for ref, out in zip(self.refs, (m_out, l_out, acc_out)):
            out[...] = ref[...]


def scores(q, k, *, sm_scale, soft_cap):
    """f32 ``q @ k.T`` scaled and capped (:func:`softmax.scale_scores`); q [rows, D], k [bk, D]."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return softmax.scale_scores(s, sm_scale=sm_scale, soft_cap=soft_cap)


class PageBlockCopier:
    """Starts / waits the DMAs of one compute block of pages into a VMEM buffer slot.

    Only pages with index ``< num_valid_pages`` are copied; the rest of the slot keeps stale data,
    which the kernel masks. Start and wait are guarded by the same predicate so they pair up.
    """

    def __init__(self, table_ref, k_hbm, v_hbm, k_buf, v_buf, sems, *, head, ppb, scale_bufs=()):
        self.table_ref = table_ref
        k_hbm, ks_hbm = quant.split(k_hbm)
        v_hbm, vs_hbm = quant.split(v_hbm)
        # (HBM source, VMEM buffer) pairs, one DMA semaphore row each: K, V, then the scales.
        self.pairs = [(k_hbm, k_buf), (v_hbm, v_buf)]
        self.scale_bufs = tuple(scale_bufs) or (None, None)
        if ks_hbm is not None:
            self.pairs += list(zip((ks_hbm, vs_hbm), scale_bufs, strict=True))
        self.k_buf, self.v_buf, self.sems = k_buf, v_buf, sems
        self.head, self.ppb = head, ppb
        self.page_size = k_buf.shape[2]

    def _each(self, table_offset, first_page, num_valid_pages, slot, action, first_valid=0):
        for j in range(self.ppb):

            @pl.when((first_page + j < num_valid_pages) & (first_page + j >= first_valid))
            def _(j=j):
                page = self.table_ref[table_offset + first_page + j]
                for kv, (src, dst) in enumerate(self.pairs):
                    copy = pltpu.make_async_copy(
                        src.at[self.head, page], dst.at[slot, j], self.sems.at[kv, slot]
                    )
                    getattr(copy, action)()

    def start(self, table_offset, first_page, num_valid_pages, slot, first_valid=0):
        self._each(table_offset, first_page, num_valid_pages, slot, "start", first_valid)

    def wait(self, table_offset, first_page, num_valid_pages, slot, first_valid=0):
        self._each(table_offset, first_page, num_valid_pages, slot, "wait", first_valid)

    def attend(self, state: VmemSoftmax, q, *, table_offset, limit, visible, sm_scale, soft_cap,
               start=0):
        """Folds keys ``[start, limit)`` of one sequence (its page table at ``table_offset``) into
        ``state``.

        Double-buffered: block ``i+1``'s pages are DMA'd HBM -> VMEM while block ``i`` is computed;
        only pages holding keys in ``[start, limit)`` are copied, and the loop starts at the block
        holding key ``start`` (a sliding window's first key: blocks wholly behind it are never
        visited). ``visible(key)`` (``key`` i32[1, bk]) masks the keys each row of ``q``
        f32[rows, D] sees; value rows outside ``[start, limit)`` (stale or NaN) are zeroed.
        """
        ppb, page_size, head_dim = self.ppb, self.page_size, self.k_buf.shape[3]
        bk = ppb * page_size
        num_pages = pl.cdiv(limit, page_size)
        num_blocks = pl.cdiv(limit, bk)
        first_page = start // page_size
        first_block = start // bk

        @pl.when(num_blocks > first_block)
        def _():
            self.start(table_offset, first_block * ppb, num_pages, first_block % 2, first_page)

        def body(i, carry):
            slot = i % 2

            @pl.when(i + 1 < num_blocks)
            def _():
                self.start(table_offset, (i + 1) * ppb, num_pages, 1 - slot, first_page)

            self.wait(table_offset, i * ppb, num_pages, slot, first_page)
            ks, vs = (None if b is None else b[slot] for b in self.scale_bufs)
            # Values, not refs; quantized pages are dequantized here, in VMEM, block by block.
            k = quant.dequantize_tile(self.k_buf[slot], ks).reshape(bk, head_dim)
            v = quant.dequantize_tile(self.v_buf[slot], vs).reshape(bk, head_dim)
            row = i * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            v = jnp.where((row < limit) & (row >= start), v, 0.0)
            key = i * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            state.update(scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap), v, visible(key))
            return carry

        lax.fori_loop(first_block, num_blocks, body, 0)
