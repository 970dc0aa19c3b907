"""Sub-byte KV pages (KIVI layout): int4 / int2 values packed into uint8, asymmetric 16-bit scales.

A packed pool is a :class:`PackedPages` pytree (one for keys, one for values)::

    values: u8[..., Hkv, P, page, D * bits / 8]   8 / bits values per byte, along the head dim
    scale:  f16[..., Hkv, P, W]                   W = D ("channel": keys) or page ("token": values)
    zero:   f16[..., Hkv, P, W]

Channel ``c`` of token ``t`` lives in byte ``c // (8 / bits)`` of row ``t``, bits
``(c % (8 / bits)) * bits`` and up (low bits first). It dequantizes as ``q * scale + zero`` with
``scale``/``zero`` of channel ``c`` (keys, KIVI's per-channel key quantization: the outlier
channels of keys get their own range) or of token ``t`` (values, per token). Quantization is
asymmetric: ``zero`` is the group's minimum (rounded to float16 first), ``scale`` spans
``[zero, max]`` in ``2**bits - 1`` steps, ``q = clip(round((x - zero) / scale), 0, 2**bits - 1)``
with the *stored* (float16) scale and zero, so what is read back is exactly
:func:`fake_quantize_page` of what was written.

Why float16 and not bfloat16: both are the 16 bits KIVI counts; float16's 11-bit significand
keeps the zero point (which every dequantized value carries whole) 8x more precise, and its range
(65504) covers KV activations. Why per page: a per-channel scale needs every token of its group,
and a page is the unit the pool moves (CoW, swap, host tier, hand-over), so a page's scales move
with it on the same page axis (axis -3 of ``values``, -2 of ``scale`` / ``zero``).

A page is quantized when it is full (:func:`close_pages`); until then it is the sequence's *open
page*, held in the model dtype outside the pool (see :mod:`pallas_kernels.kivi`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

#: ``kv_cache_dtype`` names of the packed formats -> bits per value.
PACKED_BITS = {"int4": 4, "int2": 2}
#: Scale and zero point dtype (2 bytes each).
SCALE_DTYPE = jnp.float16
#: Smallest scale stored (a constant group): float16's smallest normal.
MIN_SCALE = float(np.finfo(np.float16).tiny)
#: Which axis a group spans: "channel" (keys: one scale per channel over the page's tokens),
#: "token" (values: one scale per token over the head dim).
PER = ("channel", "token")


def bits_of(kv_cache_dtype: str) -> int:
    """Bits per value of a packed format ("int4": 4, "int2": 2).

    Raises:
      ValueError: not a packed format.
    """
    if kv_cache_dtype not in PACKED_BITS:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not a packed format; use one of "
                         f"{tuple(PACKED_BITS)}")
    return PACKED_BITS[kv_cache_dtype]


def check_dims(kv_cache_dtype: str, page_size: int, head_dim: int) -> None:
    """Raises ValueError if ``head_dim`` does not pack into whole bytes, or the page is too short
    for a per-channel key scale to mean anything (at least 2 tokens)."""
    per_byte = 8 // bits_of(kv_cache_dtype)
    if head_dim % per_byte:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} packs {per_byte} values per byte "
                         f"along the head dim: head_dim={head_dim} must be a multiple of "
                         f"{per_byte}")
    if page_size < 2:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} quantizes keys per channel over a "
                         f"page: block_size={page_size} must be >= 2")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedPages:
    """Packed sub-byte pages with asymmetric float16 scales and zero points (a pytree).

    Attributes:
      values: ``u8[..., Hkv, P, page, D * bits / 8]``.
      scale: ``f16[..., Hkv, P, W]``, ``W = D`` ("channel") or ``page`` ("token").
      zero: ``f16[..., Hkv, P, W]``.
      bits: 4 or 2 (static).
      per: "channel" or "token" (static).
    """

    values: jax.Array  # u8[..., Hkv, P, page, D * bits / 8]
    scale: jax.Array  # f16[..., Hkv, P, W]
    zero: jax.Array  # f16[..., Hkv, P, W]
    bits: int = dataclasses.field(metadata=dict(static=True), default=4)
    per: str = dataclasses.field(metadata=dict(static=True), default="channel")

    @property
    def head_dim(self) -> int:
        return int(self.values.shape[-1]) * (8 // self.bits)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (unpacked) shape ``[..., Hkv, P, page, D]``."""
        return (*self.values.shape[:-1], self.head_dim)

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.scale.nbytes + self.zero.nbytes)

    def __getitem__(self, index) -> PackedPages:
        """Indexes the leading (layer) axes of every leaf, e.g. ``pages[layer]``."""
        return dataclasses.replace(self, values=self.values[index], scale=self.scale[index],
                                   zero=self.zero[index])


def _shifts(bits: int):
    return jnp.arange(0, 8, bits, dtype=jnp.uint8)  # [8 / bits]


def pack(q: jax.Array, bits: int) -> jax.Array:  # q: u8[..., D] -> u8[..., D * bits / 8]
    """Integer codes ``[..., D]`` in ``[0, 2**bits)`` -> ``u8[..., D * bits / 8]`` (low bits
    first: channel ``c`` in byte ``c // (8 / bits)``)."""
    per_byte = 8 // bits
    q = q.astype(jnp.uint8).reshape(*q.shape[:-1], q.shape[-1] // per_byte, per_byte)
    return jnp.sum(q << _shifts(bits), axis=-1, dtype=jnp.uint8)


def unpack(values: jax.Array, bits: int) -> jax.Array:  # u8[..., D*bits/8] -> u8[..., D]
    """``u8[..., D * bits / 8]`` -> integer codes ``u8[..., D]`` (the inverse of :func:`pack`)."""
    mask = jnp.uint8((1 << bits) - 1)
    q = (values[..., None] >> _shifts(bits)) & mask  # [..., Dp, 8 / bits]
    return q.reshape(*values.shape[:-1], values.shape[-1] * (8 // bits))


def _group_axis(per: str) -> int:
    if per not in PER:
        raise ValueError(f"per={per!r} must be one of {PER}")
    return -2 if per == "channel" else -1  # reduce over tokens (channel) or over channels


def scale_zero(
    x: jax.Array,  # [..., page, D] float
    bits: int,
    per: str,
) -> tuple[jax.Array, jax.Array]:  # f16[..., D] ("channel") or f16[..., page] ("token"), twice
    """float16 ``(scale, zero)`` of pages ``x [..., page, D]``: ``[..., D]`` ("channel") or
    ``[..., page]`` ("token"); ``zero`` = the group's minimum rounded to float16, ``scale`` spans
    ``[zero, max]`` in ``2**bits - 1`` steps (at least :data:`MIN_SCALE`)."""
    axis = _group_axis(per)
    x = x.astype(jnp.float32)
    zero = jnp.min(x, axis=axis).astype(SCALE_DTYPE)
    span = jnp.max(x, axis=axis) - zero.astype(jnp.float32)
    scale = jnp.maximum(span / ((1 << bits) - 1), MIN_SCALE).astype(SCALE_DTYPE)
    return scale, zero


def _expand(s: jax.Array, per: str) -> jax.Array:
    """A group statistic broadcast against ``[..., page, D]``."""
    return s[..., None, :] if per == "channel" else s[..., None]


def encode(
    x: jax.Array,  # [..., page, D] float
    scale: jax.Array,  # f16[..., D] ("channel") or f16[..., page] ("token")
    zero: jax.Array,  # same shape as scale
    bits: int,
    per: str,
) -> jax.Array:  # u8[..., page, D] codes
    """Integer codes ``u8[..., page, D]`` of ``x`` with the stored ``scale`` and ``zero``."""
    s = _expand(scale.astype(jnp.float32), per)
    z = _expand(zero.astype(jnp.float32), per)
    q = jnp.round((x.astype(jnp.float32) - z) / s)
    return jnp.clip(q, 0, (1 << bits) - 1).astype(jnp.uint8)


def quantize_pages(x: jax.Array, bits: int, per: str) -> PackedPages:  # x: [..., page, D] float
    """Whole pages ``x [..., page, D]`` (float) -> :class:`PackedPages` (leading axes kept)."""
    scale, zero = scale_zero(x, bits, per)
    return PackedPages(pack(encode(x, scale, zero, bits, per), bits), scale, zero, bits, per)


def dequantize_tile(
    values: jax.Array,  # u8[..., page, D * bits / 8]
    scale: jax.Array,  # f16[..., D] ("channel") or f16[..., page] ("token")
    zero: jax.Array,  # same shape as scale
    bits: int,
    per: str,
) -> jax.Array:  # f32[..., page, D]
    """float32 ``[..., page, D]`` of a tile of packed pages: ``values u8[..., page, D*bits/8]``,
    ``scale``/``zero`` ``[..., D]`` ("channel") or ``[..., page]`` ("token"). The one dequantize
    the jnp reference and the XLA path share."""
    q = unpack(values, bits).astype(jnp.float32)
    return q * _expand(scale.astype(jnp.float32), per) + _expand(zero.astype(jnp.float32), per)


def dequantize(pages: PackedPages) -> jax.Array:
    """A whole packed pool in float32 (references and tests only: kernels dequantize per tile)."""
    return dequantize_tile(pages.values, pages.scale, pages.zero, pages.bits, pages.per)


def fake_quantize_page(x: jax.Array, bits: int, per: str) -> jax.Array:  # [..., page, D] -> f32
    """What full pages ``x [..., page, D]`` read back as once closed (float32)."""
    return dequantize(quantize_pages(x, bits, per))


def zeros(shape: tuple[int, ...], bits: int, per: str) -> PackedPages:
    """A zeroed packed pool of logical shape ``[..., Hkv, P, page, D]``."""
    *lead, page, d = shape
    if d % (8 // bits):
        raise ValueError(f"head_dim={d} is not a multiple of {8 // bits} ({bits}-bit packing)")
    width = d if per == "channel" else page
    scale, zero = (jnp.zeros((*lead, width), SCALE_DTYPE) for _ in range(2))  # two buffers
    return PackedPages(jnp.zeros((*lead, page, d * bits // 8), jnp.uint8), scale, zero, bits, per)


def close_pages(
    pool: PackedPages,  # values u8[L, Hkv, P, page, D*bits/8]; scale/zero f16[L, Hkv, P, W]
    pages: jax.Array,  # [L, Hkv, n, page, D] float: full pages to close
    page_ids: jax.Array,  # i32[n] destination pool pages (NULL_PAGE = 0 for padding)
) -> PackedPages:
    """Quantize-on-fill: writes full open pages into the packed pool at ``page_ids`` (traceable;
    scatters update a donated pool in place). Padding rows land in the null page."""
    q = quantize_pages(pages, pool.bits, pool.per)
    return PackedPages(pool.values.at[:, :, page_ids].set(q.values),
                       pool.scale.at[:, :, page_ids].set(q.scale),
                       pool.zero.at[:, :, page_ids].set(q.zero), pool.bits, pool.per)


def host_zeros(pages: PackedPages, num_pages: int) -> PackedPages:
    """numpy zeros shaped like ``pages`` with ``num_pages`` on the page axis (host swap space)."""
    def one(x, axis):
        shape = list(x.shape)
        shape[axis] = num_pages
        return np.zeros(shape, np.dtype(x.dtype))

    return PackedPages(one(pages.values, -3), one(pages.scale, -2), one(pages.zero, -2),
                       pages.bits, pages.per)


def page_bytes(page_size: int, head_dim: int, bits: int, per: str) -> int:
    """Bytes of one packed page of one KV head (values, scale and zero): what
    ``paged.accounting.formulas`` counts per (layer, KV head) of K or of V."""
    width = head_dim if per == "channel" else page_size
    return page_size * head_dim * bits // 8 + 2 * width * jnp.dtype(SCALE_DTYPE).itemsize
