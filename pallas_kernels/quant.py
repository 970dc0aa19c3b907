"""Quantized KV pages: int8 / fp8 values with float32 scales, and the one dequantize every path uses.

A quantized pool is a :class:`QuantizedPages` pytree in place of a plain page array::

    values: [..., Hkv, P, page, D]   int8 | float8_e4m3fn | float8_e5m2
    scales: f32[..., Hkv, P, S]      S = page ("token": one scale per (token, KV head))
                                      S = 1    ("page":  one scale per (page, KV head))

Key ``j`` of page ``p`` dequantizes as ``values[h, p, j] * scales[h, p, j if S == page else 0]``;
:func:`dequantize_tile` is that product on any tile (the trailing ``S`` axis broadcasts over the
page's tokens), so the reference, the XLA path and the Pallas kernels share it. The page axis of
both leaves is the same (-3 of values, -2 of scales), so moving a page (copy-on-write, swap, NaN
poison) moves its scales with it by mapping the same index over both leaves.

Quantization is symmetric (no zero point). Scales are float32: 4 bytes per (token, head) against
``D`` value bytes is 3% at ``D = 128``, and a bfloat16 scale would add its own 8-bit-mantissa error
to every dequantized value (int8 already has ~0.4% step error; a bf16 scale adds up to 0.4% more).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

#: ``EngineConfig.kv_cache_dtype`` names of the quantized formats -> their storage dtype name.
QUANT_DTYPES = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
#: Scale layouts (see the module docstring).
GRANULARITIES = ("page", "token")
#: A "page" scale is fixed when the page's first token is written: ``amax(token) * HEADROOM /
#: qmax``; later tokens of the page are clipped to that range. See :func:`quantize_tokens`.
PAGE_SCALE_HEADROOM = 2.0
SCALE_DTYPE = jnp.float32


def storage_dtype(kv_cache_dtype: str):
    """The jnp dtype of ``kv_cache_dtype`` ("int8", "fp8_e4m3", "fp8_e5m2").

    Raises:
      ValueError: an unknown name, or an fp8 format this JAX / ml_dtypes does not provide.
    """
    if kv_cache_dtype not in QUANT_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not a quantized format; "
                         f"use one of {tuple(QUANT_DTYPES)}")
    name = QUANT_DTYPES[kv_cache_dtype]
    dtype = getattr(jnp, name, None)
    if dtype is None:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs jnp.{name}, which this JAX "
                         f"({jax.__version__}) does not provide")
    return jnp.dtype(dtype)


def check_backend(kv_cache_dtype: str, backend: str | None = None) -> None:
    """Raises ValueError if ``backend`` (default: JAX's default) cannot store and convert the
    format (one tiny jitted convert, run once at engine construction)."""
    dtype = storage_dtype(kv_cache_dtype)
    backend = backend or jax.default_backend()
    try:
        x = jax.device_put(jnp.ones((2,), jnp.float32), jax.devices(backend)[0])
        jax.block_until_ready(jax.jit(lambda x: x.astype(dtype).astype(jnp.float32))(x))
    except Exception as err:  # noqa: BLE001  (any lowering failure means: not supported here)
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} ({dtype.name}) is not supported on "
                         f"the {backend!r} backend: {type(err).__name__}: {err}") from err


def qmax(dtype) -> float:
    """Largest magnitude a quantized value may take (int8: 127, symmetric; fp8: largest finite)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return 127.0
    return float(jnp.finfo(dtype).max)


def scale_width(granularity: str, page_size: int) -> int:
    """``S``, the trailing axis of the scales: ``page_size`` for "token", 1 for "page"."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"kv_scale_granularity={granularity!r} must be one of {GRANULARITIES}")
    return page_size if granularity == "token" else 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """Quantized pages and their scales (a pytree; both leaves share the page axis).

    Attributes:
      values: ``[..., Hkv, P, page, D]`` int8 / fp8.
      scales: f32 ``[..., Hkv, P, S]`` with ``S`` = page (per token) or 1 (per page).
    """

    values: jax.Array  # [..., Hkv, P, page, D]
    scales: jax.Array  # f32[..., Hkv, P, S]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.scales.nbytes)

    @property
    def granularity(self) -> str:
        return "page" if self.scales.shape[-1] == 1 and self.values.shape[-2] != 1 else "token"

    def __getitem__(self, index) -> QuantizedPages:
        """Indexes the leading (layer) axes of both leaves, e.g. ``pages[layer]``."""
        return QuantizedPages(self.values[index], self.scales[index])


def split(pages) -> tuple[jax.Array, jax.Array | None]:
    """``(values, scales)`` of quantized pages, ``(pages, None)`` of plain ones."""
    if isinstance(pages, QuantizedPages):
        return pages.values, pages.scales
    return pages, None


def dequantize_tile(values: jax.Array, scales: jax.Array | None) -> jax.Array:
    """float32 ``values [..., page, D] * scales [..., S]`` (S = page or 1); plain if no scales."""
    x = values.astype(jnp.float32)
    if scales is None:
        return x
    return x * scales.astype(jnp.float32)[..., None]


def dequantize(pages) -> jax.Array:
    """A whole pool in float32 (references and tests only: kernels dequantize per tile)."""
    return dequantize_tile(*split(pages))


def encode(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``x / scale`` (``scale`` broadcast over the last axis) stored as ``dtype``: rounded to
    nearest and clipped to ``±qmax`` for int8, clipped and cast (round-to-nearest-even) for fp8."""
    y = x.astype(jnp.float32) / scale[..., None]
    limit = qmax(dtype)
    y = jnp.clip(y, -limit, limit)
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype)


def token_scale(x: jax.Array, dtype, headroom: float = 1.0) -> jax.Array:
    """f32 ``amax(|x|) * headroom / qmax`` over the last axis (a zero vector gets a tiny scale,
    so that encoding it gives zeros, never NaN)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    return jnp.maximum(amax * headroom, jnp.finfo(jnp.float32).tiny) / qmax(dtype)


def fake_quantize(x: jax.Array, dtype, scale: jax.Array | None = None) -> jax.Array:
    """Quantize then dequantize over the last axis (per vector, or with a given ``scale``) in
    float32: what a value read back from a quantized page equals. The no-cache references use it."""
    if scale is None:
        scale = token_scale(x, dtype)
    return encode(x, scale, dtype).astype(jnp.float32) * scale[..., None]


def quantize_pool(x: jax.Array, dtype, granularity: str) -> QuantizedPages:
    """Quantizes a float pool ``[..., Hkv, P, page, D]`` at once (tests and benchmarks; the engine
    writes token by token with :func:`quantize_tokens`' semantics, which this matches for pages
    written whole)."""
    dtype = jnp.dtype(dtype)
    if granularity == "token":
        scales = token_scale(x, dtype)  # [..., P, page]
        return QuantizedPages(encode(x, scales, dtype), scales)
    scale_width(granularity, x.shape[-2])
    first = token_scale(x[..., 0, :], dtype, PAGE_SCALE_HEADROOM)  # [..., P]
    values = encode(x, jnp.broadcast_to(first[..., None], x.shape[:-1]), dtype)
    return QuantizedPages(values, first[..., None])


def zeros(shape: tuple[int, ...], dtype, granularity: str) -> QuantizedPages:
    """A zeroed quantized pool of value shape ``[..., Hkv, P, page, D]`` (numpy-free, jnp)."""
    width = scale_width(granularity, shape[-2])
    return QuantizedPages(jnp.zeros(shape, dtype), jnp.zeros((*shape[:-2], width), SCALE_DTYPE))


def host_zeros(pages, num_pages: int):
    """numpy zeros shaped like ``pages`` (plain or quantized) with ``num_pages`` on the page axis
    (the swap space on the host)."""
    def one(x, page_axis):
        shape = list(x.shape)
        shape[page_axis] = num_pages
        return np.zeros(shape, np.dtype(x.dtype))

    if isinstance(pages, QuantizedPages):
        return QuantizedPages(one(pages.values, -3), one(pages.scales, -2))
    return one(pages, -3)


def bytes_per_token_head(head_dim: int, dtype, granularity: str, page_size: int) -> float:
    """Bytes one (token, KV head) of K (or of V) costs in a quantized pool, scales included
    (page scales spread over the page's tokens)."""
    value = head_dim * jnp.dtype(dtype).itemsize
    return value + jnp.dtype(SCALE_DTYPE).itemsize * scale_width(granularity, page_size) / page_size


def query_dtype(pages, compute_dtype):
    """The dtype queries are given to a kernel in: the pages' dtype, or ``compute_dtype`` when
    the pages are quantized (a query is never quantized)."""
    return jnp.dtype(compute_dtype) if isinstance(pages, QuantizedPages) else pages.dtype


def fake_quantize_sequence(x: jax.Array, dtype, granularity: str, page_size: int) -> jax.Array:
    """What a contiguous sequence's K or V ``[B, S, Hkv, D]`` (position 0 at the start of a page)
    reads back as after it is written into quantized pages, token by token or in any chunks:
    "token" quantizes each (token, head) vector alone; "page" uses the scale the page's first token
    fixed (:data:`PAGE_SCALE_HEADROOM`) for every token of the page. The no-cache reference."""
    dtype = jnp.dtype(dtype)
    if granularity == "token":
        return fake_quantize(x, dtype)
    scale_width(granularity, page_size)
    first = (jnp.arange(x.shape[1]) // page_size) * page_size
    scale = token_scale(x[:, first], dtype, PAGE_SCALE_HEADROOM)  # [B, S, Hkv]
    return fake_quantize(x, dtype, scale)


def write_tokens(
    pages: QuantizedPages,  # values [L, Hkv, P, page, D]; scales [L, Hkv, P, S]
    x: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]
    layer,
) -> QuantizedPages:
    """Quantizes ``x`` into layer ``layer`` of a stacked quantized pool at ``slot_mapping``
    (traceable; the scatters update the donated pool in place).

    "token": each (token, head) gets its own scale. "page": a token written at offset 0 of its page
    sets the page's scale (``amax * PAGE_SCALE_HEADROOM / qmax``) first, then every token is encoded
    with its page's scale and clipped. The scale thus depends only on the page's first token, not on
    how the page's tokens were split over steps, so chunked prefill, prefix reuse, copy-on-write and
    a rolled-back draft (its slot, offset 0 included, is written again when the position is
    re-fed) read back the same values as one whole write.
    """
    values, scales = pages.values, pages.scales
    num_layers, hkv, num_pages, page_size, d = values.shape
    dtype = values.dtype
    if scales.shape[-1] == page_size:
        s = token_scale(x, dtype)  # [T, Hkv]
        flat = scales.reshape(num_layers, hkv, num_pages * page_size)
        scales = flat.at[layer, :, slot_mapping].set(s, mode="drop").reshape(scales.shape)
    else:
        page = slot_mapping // page_size
        first = jnp.where(slot_mapping % page_size == 0, page, num_pages)  # others dropped
        s0 = token_scale(x, dtype, PAGE_SCALE_HEADROOM)
        scales = scales.at[layer, :, first, 0].set(s0, mode="drop")
        s = scales[layer, :, page, 0]  # [T, Hkv]
    flat = values.reshape(num_layers, hkv, num_pages * page_size, d)
    values = flat.at[layer, :, slot_mapping].set(encode(x, s, dtype), mode="drop")
    return QuantizedPages(values.reshape(pages.values.shape), scales)


def as_float(pages):
    """Plain pages unchanged; quantized pages dequantized to float32 (references only)."""
    return dequantize(pages) if isinstance(pages, QuantizedPages) else pages


def asarray(pages):
    """``jnp.asarray`` of every leaf (plain or quantized pages)."""
    return jax.tree.map(jnp.asarray, pages)
