"""Pieces shared by the GPU-style (Triton lowering) kernels: config, constraints, gathers, softmax.

Constraints (checked, ValueError): ``page_size`` and ``head_dim`` powers of two (Triton block
shapes), ``page_size`` in [8, 256], ``head_dim >= 16``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from pallas_kernels import compat, validation


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class GpuPagedConfig:
    """Tuning knobs of the GPU-style paged kernels.

    Attributes:
      pages_per_compute_block: pages per loop step (a power of two; raised so a block holds at
        least 16 keys, clipped to the partition).
      k_splits: partitions of each sequence's pages (decode only).
      queries_per_block: query tokens per ragged tile (raised so a tile has >= ``min_block_h`` rows).
      min_block_h: least rows of a query tile (Triton ``dot`` needs 16).
      num_warps, num_stages: Triton launch parameters.
      masked_gather: gather pages with a masked load (never touches pages past a length); False
        reads the null page instead (see :func:`load_pages`).
    """

    pages_per_compute_block: int = 4
    k_splits: int = 8
    queries_per_block: int = 16
    min_block_h: int = 16
    num_warps: int = 4
    num_stages: int = 2
    masked_gather: bool = True

    def __post_init__(self):
        names = ("pages_per_compute_block", "k_splits", "queries_per_block", "min_block_h")
        for name in names + ("num_warps",):
            value = getattr(self, name)
            if not isinstance(value, int) or not _pow2(value):
                raise ValueError(f"{name}={value!r} must be a positive power of two")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages!r} must be a positive int")


def check_gpu_constraints(shp: validation.PagedShape, config: GpuPagedConfig) -> int:
    """Validates what the GPU-style kernels can tile; returns the pages per compute block."""
    page_size, head_dim = shp.page_size, shp.head_dim
    if not _pow2(page_size) or not 8 <= page_size <= 256:
        raise ValueError(
            f"{page_size=} must be a power of two in [8, 256] for the GPU-style kernel"
        )
    if not _pow2(head_dim) or head_dim < 16:
        raise ValueError(f"{head_dim=} must be a power of two >= 16 for the GPU-style kernel")
    ppb = max(config.pages_per_compute_block, next_pow2(-(-16 // page_size)))
    return min(ppb, next_pow2(shp.pages_per_seq))


def dot(a, b, *, trans_b=False):
    """f32-accumulating dot; full precision for f32 inputs (Triton would otherwise use TF32)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def load_pages(pages_ref, ids, page_valid, *, dtype, masked: bool = True):
    """Gathers pages ``ids`` from a ``[P, page, D]`` ref -> ``[len(ids) * page, D]``.

    ``masked``: lanes of invalid pages are never dereferenced and read as 0. Otherwise (the form
    JAX's own GPU kernel uses, a fallback should the masked gather not lower) invalid pages are
    redirected to the null page 0, which is read and later masked.
    """
    _, page_size, head_dim = pages_ref.shape
    if not masked:
        x = pages_ref[jnp.where(page_valid, ids, 0)]
        return x.reshape(ids.shape[0] * page_size, head_dim).astype(dtype)
    shape = (ids.shape[0], page_size, head_dim)
    # Full integer indexers (not ids + slices): the form both Triton and interpret mode gather with.
    index = (
        jnp.broadcast_to(ids[:, None, None], shape),
        jnp.broadcast_to(jnp.arange(page_size)[None, :, None], shape),
        jnp.broadcast_to(jnp.arange(head_dim)[None, None, :], shape),
    )
    mask = jnp.broadcast_to(page_valid[:, None, None], shape)
    x = compat.plgpu.load(pages_ref.at[index], mask=mask, other=0.0)
    return x.reshape(ids.shape[0] * page_size, head_dim).astype(dtype)


def online_update(carry, s, v, valid):
    """Register-resident online softmax step: s f32[rows, bk], v [bk, D], valid bool[rows|1, bk]."""
    m, lsum, acc = carry
    s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    lsum = alpha * lsum + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + dot(p.astype(v.dtype), v)
    return m_new, lsum, acc


def merge_partials(o, m, lsum):
    """Combines split-K partials: o f32[S, ..., D], m / lsum f32[S, ...] -> normalised f32[..., D]."""
    m_max = jnp.max(m, axis=0)
    m_safe = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    w = jnp.exp(m - m_safe[None])  # 0 for empty partitions (m = -inf)
    num = jnp.sum(o * w[..., None], axis=0)
    den = jnp.sum(lsum * w, axis=0)
    return num / jnp.where(den == 0.0, 1.0, den)[..., None]
