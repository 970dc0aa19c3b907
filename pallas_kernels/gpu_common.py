"""Pieces shared by the GPU-style (Triton lowering) kernels: config, constraints, page gathers.

Constraints (checked, ValueError): ``page_size`` and ``head_dim`` powers of two (Triton block
shapes), ``page_size`` in [8, 256], ``head_dim >= 16``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, quant, softmax, validation


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


DEFAULT_PAGES_PER_COMPUTE_BLOCK = 4  # where nothing chooses (ragged kernel, constraint checks)


@dataclasses.dataclass(frozen=True)
class GpuPagedConfig:
    """Tuning knobs of the GPU-style paged kernels.

    Attributes:
      pages_per_compute_block: pages per loop step (a power of two; raised so a block holds at
        least 16 keys, clipped to the partition). None: the decode kernel takes
        :func:`pallas_kernels.gpu_tuning.decode_splits`'s choice, the ragged kernel
        ``DEFAULT_PAGES_PER_COMPUTE_BLOCK``.
      k_splits: partitions of each sequence's pages (decode only). None: chosen by
        :func:`pallas_kernels.gpu_tuning.decode_splits` from the shape and the device's SM count.
      queries_per_block: query tokens per ragged tile (raised so a tile has >= ``min_block_h`` rows).
      min_block_h: least rows of a query tile (Triton ``dot`` needs 16).
      num_warps, num_stages: Triton launch parameters.
      masked_gather: gather pages with a masked load (never touches pages past a length); False
        reads the null page instead (see :func:`load_pages`).
    """

    pages_per_compute_block: int | None = None
    k_splits: int | None = None
    queries_per_block: int = 16
    min_block_h: int = 16
    num_warps: int = 4
    num_stages: int = 2
    masked_gather: bool = True

    def __post_init__(self):
        names = ("pages_per_compute_block", "k_splits", "queries_per_block", "min_block_h")
        for name in names + ("num_warps",):
            value = getattr(self, name)
            if value is None and name in ("pages_per_compute_block", "k_splits"):
                continue  # chosen per shape (see the attributes)
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
    ppb = config.pages_per_compute_block or DEFAULT_PAGES_PER_COMPUTE_BLOCK
    ppb = max(ppb, next_pow2(-(-16 // page_size)))
    return min(ppb, next_pow2(shp.pages_per_seq))


def pallas_call(kernel, *, config, interpret: bool, name: str, **kwargs):
    """``pl.pallas_call`` with the Triton launch parameters of ``config`` (``num_warps``,
    ``num_stages``)."""
    params = compat.gpu_compiler_params(num_warps=config.num_warps, num_stages=config.num_stages)
    return pl.pallas_call(kernel, compiler_params=params, interpret=interpret, name=name, **kwargs)


def dot(a, b, *, trans_b=False):
    """f32-accumulating dot; full precision for f32 inputs (Triton would otherwise use TF32)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def load_pages(pages_ref, ids, page_valid, *, dtype, masked: bool = True):
    """Gathers pages ``ids`` from a ``[P, page, D]`` ref -> ``[len(ids) * page, D]``.

    ``masked``: lanes of invalid pages are never dereferenced and read as 0. Otherwise (the form
    JAX's own GPU kernel uses, a fallback should the masked gather not lower) invalid pages are
    redirected to the null page 0, which is read and later masked. A ``QuantizedPages`` of refs
    (values ``[P, page, D]``, scales ``[P, S]``) loads the pages' values and scales the same way
    and dequantizes them here, in registers.
    """
    values_ref, scales_ref = quant.split(pages_ref)
    x = _load(values_ref, ids, page_valid, masked=masked)  # [ppb, page, D]
    if scales_ref is not None:
        scales = _load(scales_ref, ids, page_valid, masked=masked)  # [ppb, S]
        x = quant.dequantize_tile(x, scales)
    return x.reshape(ids.shape[0] * x.shape[1], x.shape[2]).astype(dtype)


def head_spec(pages, head_of):
    """BlockSpec of one KV head's whole pages (``[Hkv, P, page, D]`` -> ``[P, page, D]``), the
    head chosen by ``head_of(*grid_indices)``; a ``QuantizedPages`` of BlockSpecs (scales
    ``[Hkv, P, S]`` -> ``[P, S]``, the same head) for quantized pages."""
    def spec(x):
        return pl.BlockSpec((None, *x.shape[1:]),
                            lambda *g: (head_of(*g),) + (0,) * (len(x.shape) - 1))

    if isinstance(pages, quant.QuantizedPages):
        return quant.QuantizedPages(spec(pages.values), spec(pages.scales))
    return spec(pages)


def _load(ref, ids, page_valid, *, masked: bool):
    """``ref[ids]`` of a ``[P, ...]`` ref (every trailing axis whole), masked per page."""
    if not masked:
        return ref[jnp.where(page_valid, ids, 0)]
    shape = (ids.shape[0], *ref.shape[1:])
    lead = (slice(None),) + (None,) * (len(shape) - 1)
    index = [jnp.broadcast_to(ids[lead], shape)]
    for axis in range(1, len(shape)):
        iota = jnp.arange(shape[axis]).reshape([-1 if a == axis else 1 for a in range(len(shape))])
        index.append(jnp.broadcast_to(iota, shape))
    mask = jnp.broadcast_to(page_valid[lead], shape)
    return compat.plgpu.load(ref.at[tuple(index)], mask=mask, other=0)


def scores(q, k, *, sm_scale, soft_cap):
    """f32 ``q @ k.T`` scaled and capped (:func:`softmax.scale_scores`); q [rows, D], k [bk, D]."""
    return softmax.scale_scores(dot(q, k, trans_b=True), sm_scale=sm_scale, soft_cap=soft_cap)


def online_update(carry, s, v, valid):
    """Register-resident online softmax step (:func:`softmax.online_softmax_step`): s f32[rows, bk],
    v [bk, D] (masked rows zeroed), valid bool[rows|1, bk]; p is cast to v's dtype for the dot."""
    return softmax.online_softmax_step(
        carry, s, v, valid, pv=lambda p, v: dot(p.astype(v.dtype), v)
    )


def attend_pages(carry, q, k_ref, v_ref, ids, *, first_key, limit, visible, masked, sm_scale,
                 soft_cap, start=0):  # fmt: skip
    """Folds one compute block of pages into the register state ``carry``.

    ``ids`` i32[ppb] the block's page ids, holding keys ``first_key + [0, ppb * page)``; pages
    starting at or past ``limit``, or ending at or before ``start`` (a sliding window's first
    key), are not dereferenced (:func:`load_pages`) and value rows outside ``[start, limit)`` are
    zeroed. ``visible(key)`` (``key`` i32[1, bk]) masks the keys each row of ``q`` ``[rows, D]``
    sees.
    """
    ppb, page_size = ids.shape[0], k_ref.shape[1]
    page_first = first_key + jnp.arange(ppb) * page_size
    page_valid = (page_first < limit) & (page_first + page_size > start)
    k = load_pages(k_ref, ids, page_valid, dtype=q.dtype, masked=masked)
    v = load_pages(v_ref, ids, page_valid, dtype=q.dtype, masked=masked)
    key = first_key + jnp.arange(ppb * page_size)
    v = jnp.where(((key < limit) & (key >= start))[:, None], v, jnp.zeros_like(v))
    s = scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap)
    return online_update(carry, s, v, visible(key[None, :]))
