"""Pieces shared by the TPU-style (Mosaic) kernels: config, constraints, page DMA, softmax step.

Constraints (checked, ValueError): ``page_size`` a multiple of 8 (16 for 16-bit dtypes, the sublane
tile) in [8, 256], ``head_dim`` a multiple of 64, the K/V double buffers within
``vmem_limit_bytes``, one sequence's page table within ``max_prefetch_entries`` (SMEM).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import validation


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


class PageBlockCopier:
    """Starts / waits the DMAs of one compute block of pages into a VMEM buffer slot.

    Only pages with index ``< num_valid_pages`` are copied; the rest of the slot keeps stale data,
    which the kernel masks. Start and wait are guarded by the same predicate so they pair up.
    """

    def __init__(self, table_ref, k_hbm, v_hbm, k_buf, v_buf, sems, *, head, ppb):
        self.table_ref, self.k_hbm, self.v_hbm = table_ref, k_hbm, v_hbm
        self.k_buf, self.v_buf, self.sems = k_buf, v_buf, sems
        self.head, self.ppb = head, ppb

    def _each(self, table_offset, first_page, num_valid_pages, slot, action):
        for j in range(self.ppb):

            @pl.when(first_page + j < num_valid_pages)
            def _(j=j):
                page = self.table_ref[table_offset + first_page + j]
                for kv, (src, dst) in enumerate(
                    ((self.k_hbm, self.k_buf), (self.v_hbm, self.v_buf))
                ):
                    copy = pltpu.make_async_copy(
                        src.at[self.head, page], dst.at[slot, j], self.sems.at[kv, slot]
                    )
                    getattr(copy, action)()

    def start(self, table_offset, first_page, num_valid_pages, slot):
        self._each(table_offset, first_page, num_valid_pages, slot, "start")

    def wait(self, table_offset, first_page, num_valid_pages, slot):
        self._each(table_offset, first_page, num_valid_pages, slot, "wait")


def online_softmax_update(m_ref, l_ref, acc_ref, s, v, valid):
    """Folds one block into the VMEM softmax state.

    ``s`` f32[rows, bk] scaled (and capped) scores, ``v`` f32[bk, D], ``valid`` bool broadcastable
    to ``s`` (masked keys). Rows with no valid key so far keep ``m = -inf`` and contribute nothing.
    """
    s = jnp.where(valid, s, -jnp.inf)
    m_prev = m_ref[...]  # [rows, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32)
    m_ref[...] = m_new


def scores(q, k, *, sm_scale, soft_cap):
    """f32 ``q @ k.T * sm_scale`` with the optional soft cap; q [rows, D], k [bk, D]."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s
