"""Paged KV cache: device state as a pytree, changed only by pure jitted functions.

Layout (the one of JAX's own Pallas paged-attention kernels, layers stacked in front)::

    k_pages, v_pages: [num_layers, num_kv_heads, num_pages, page_size, head_dim]

With int8 / fp8 each of ``k_pages`` / ``v_pages`` is a ``pallas_kernels.quant.QuantizedPages``
(values plus f32 scales ``[L, Hkv, P, S]``, ``S`` = page_size or 1); int4 / int2 pages are packed
(``pallas_kernels.packed``) with open pages in ``open_k`` / ``open_v`` (``paged.kv.packed_cache``).
Page operations map one page index over all leaves (page axis 2), so CoW, swap and poison move a
page's scales with its values. ``page_bounds`` adds ``key_bounds [L, Hkv, P, 2, D]`` (each page's
key min and max, for sparse decode); ``attn_mass`` adds ``f32[L, Hkv, P, page, 1]`` (each slot's
accumulated attention mass, for KV policies, ``paged.kv.mass``). Both travel with the keys: every
page copy, read and write moves ``key_side(cache)``, so CoW, swap, host tier and hand-over keep them.

Page ``NULL_PAGE`` (0) is the null page: page-table padding points at it and padded tokens write
into it. It is never handed to a sequence, so its content is garbage by design (debug mode even fills
it with NaN) and no kernel may read it for a real position.

Every operation that changes the cache takes it as its first argument and DONATES it: XLA updates
the pages in place and the caller must use the returned cache, never the argument again. Index
arrays (pages, slots) may be padded with ``NULL_PAGE`` entries; the helpers ``pad_pages`` and
``pad_slots`` round their lengths up to powers of two so a long run compiles a handful of shapes.
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from paged.kv import packed_cache
from paged.kv.paging import NULL_PAGE, next_pow2  # noqa: F401 (re-exported)
from paged.util import validate
from pallas_kernels import packed, page_select, quant
from pallas_kernels.quant import QuantizedPages


@flax.struct.dataclass
class KVCache:
    """Stacked per-layer K/V pages.

    Attributes:
      k_pages: ``[num_layers, num_kv_heads, num_pages, page_size, head_dim]``, or a
        ``QuantizedPages`` of values that shape plus scales (see the module docstring).
      v_pages: same shape and dtype as ``k_pages``.
    """

    k_pages: jax.Array | QuantizedPages  # [L, Hkv, P, page, D]
    v_pages: jax.Array | QuantizedPages  # [L, Hkv, P, page, D]
    key_bounds: jax.Array | None = None  # [L, Hkv, P, 2, D]: per page key min (0) and max (1)
    # Packed (int4 / int2) pages: open pages in the model dtype by slot (paged.kv.open_pages).
    open_k: jax.Array | None = None  # [L, Hkv, num_slots, page, D]
    open_v: jax.Array | None = None  # [L, Hkv, num_slots, page, D]
    attn_mass: jax.Array | None = None  # f32[L, Hkv, P, page, 1]: per slot accumulated mass

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_kv_heads: int,
        num_pages: int,
        page_size: int,
        head_dim: int,
        dtype=jnp.float32,
        *,
        sharding: jax.sharding.Sharding | None = None,
        kv_cache_dtype: str = "auto",
        scale_granularity: str = "token",
        page_bounds: bool = False,
        open_slots: int = 0,
        attn_mass: bool = False,
    ) -> KVCache:
        """Allocates a zeroed cache; ``num_pages`` includes the null page.

        Args:
          dtype: the page dtype when ``kv_cache_dtype == "auto"``.
          sharding: of the pages (KV heads on axis 1); scales get the same (their heads follow).
          kv_cache_dtype: "auto" (``dtype``) or a quantized format ("int8", "fp8_e4m3",
            "fp8_e5m2"; "int4", "int2": ``pallas_kernels.packed.PackedPages``, keys per channel
            and values per token, written page by page with ``packed.close_pages``).
          scale_granularity: "token" (per (token, KV head)) or "page" (per (page, KV head)).
          page_bounds: also hold each page's key bounds (``key_bounds``, in ``dtype``; of the
            dequantized keys for int8 / fp8 pages; not for packed int4 / int2 pages).
          open_slots: packed formats: slots of ``open_k`` / ``open_v`` (0: none, ops only).
          attn_mass: also hold each slot's attention mass (``attn_mass``, f32; KV policies).

        Raises:
          TypeError: a dimension is not an integer (``bool`` and floats included).
          ValueError: a dimension is not positive, ``num_pages < 2``, or an unknown
            ``kv_cache_dtype`` / ``scale_granularity``.
        """
        dims = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, num_pages=num_pages,
                    page_size=page_size, head_dim=head_dim)
        for name, value in dims.items():
            validate.integer(name, value, minimum=1)
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is the null page)")
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        if kv_cache_dtype == "auto":
            zeros = functools.partial(jnp.zeros, shape, dtype)
        elif kv_cache_dtype in packed.PACKED_BITS:  # keys per channel, values per token (KIVI)
            if page_bounds:
                raise ValueError(f"page_bounds: not kept for packed {kv_cache_dtype} pages")
            k, v, ok, ov = packed_cache.zeros(kv_cache_dtype, shape, dtype, open_slots, sharding)
            return cls(k_pages=k, v_pages=v, open_k=ok, open_v=ov)
        else:
            qdtype = quant.storage_dtype(kv_cache_dtype)
            quant.scale_width(scale_granularity, page_size)
            zeros = functools.partial(quant.zeros, shape, qdtype, scale_granularity)
        if sharding is not None:
            # The scales' KV-head axis is axis 1 like the pages': one sharding serves every leaf.
            zeros = jax.jit(zeros, out_shardings=sharding)
        side = lambda on, tail, dt: jax.jit(functools.partial(  # noqa: E731 (sharded zeros)
            jnp.zeros, shape[:3] + tail, dt), out_shardings=sharding)() if on else None
        return cls(k_pages=zeros(), v_pages=zeros(), key_bounds=side(page_bounds, (2, head_dim),
                   dtype), attn_mass=side(attn_mass, (page_size, 1), jnp.float32))

    # The pool's dimensions (ints) and page dtype, read off the key pages.
    num_layers = property(lambda self: self.k_pages.shape[0])
    num_kv_heads = property(lambda self: self.k_pages.shape[1])
    num_pages = property(lambda self: self.k_pages.shape[2])
    page_size = property(lambda self: self.k_pages.shape[3])
    head_dim = property(lambda self: self.k_pages.shape[4])
    dtype = property(lambda self: self.k_pages.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool: pages, scales and page metadata."""
        return int(self.k_pages.nbytes + self.v_pages.nbytes) + self.metadata_nbytes

    @property
    def open_nbytes(self) -> int:
        """Bytes of the open-page buffers of packed pages (outside the pool; 0 otherwise)."""
        return 0 if self.open_k is None else int(self.open_k.nbytes + self.open_v.nbytes)

    @property
    def metadata_nbytes(self) -> int:
        """Bytes of the pages' key bounds and slots' attention mass (0 without them)."""
        return sum(int(x.nbytes) for x in (self.key_bounds, self.attn_mass) if x is not None)

    @property
    def scale_nbytes(self) -> int:
        """Bytes of the scales (and zero points of packed pages; 0 for an unquantized cache)."""
        if isinstance(self.k_pages, packed.PackedPages):
            return sum(int(p.scale.nbytes + p.zero.nbytes) for p in (self.k_pages, self.v_pages))
        return sum(int(s.nbytes) for s in (quant.split(self.k_pages)[1], quant.split(self.v_pages)[1])
                   if s is not None)


def write_layer(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim], or [L, ...] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[num_tokens]: page * page_size + offset
    *,
    layer: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatters one layer's new K/V into its pages (traceable; use inside a jitted step).

    With ``layer``, the pages are the stacked cache ``[L, Hkv, P, page, D]`` and the write goes
    into layer ``layer`` with one scatter on the stacked array: slicing the layer out, writing and
    setting it back would make XLA copy the layer every step instead of updating the donated cache
    in place. Padded tokens must carry a slot inside ``NULL_PAGE`` (0 .. page_size-1). Quantized
    pages (``QuantizedPages``) are written by ``pallas_kernels.quant.write_tokens``.
    """
    if isinstance(k_pages, packed.PackedPages):
        raise TypeError("packed (int4/int2) pages are not written token by token: a page is "
                        "quantized when it fills (pallas_kernels.packed.close_pages)")
    if isinstance(k_pages, QuantizedPages):
        return _write_quantized(k_pages, k, slot_mapping, layer), _write_quantized(
            v_pages, v, slot_mapping, layer)
    shape = k_pages.shape
    *lead, num_pages, page_size, d = shape
    flat = (*lead[:-1], lead[-1], num_pages * page_size, d)  # [(L,) Hkv, P * page, D]
    k, v = k.astype(k_pages.dtype), v.astype(v_pages.dtype)
    if layer is None:
        # [Hkv, slots] indexing: updates are [Hkv, T, D].
        index = (slice(None), slot_mapping)
        k, v = jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)
    else:
        # [layer, :, slots]: the advanced indices are split by a slice, so updates are [T, Hkv, D].
        index = (layer, slice(None), slot_mapping)
    k_pages = k_pages.reshape(flat).at[index].set(k, mode="drop")
    v_pages = v_pages.reshape(flat).at[index].set(v, mode="drop")
    return k_pages.reshape(shape), v_pages.reshape(shape)


def _write_quantized(pages: QuantizedPages, x, slot_mapping, layer) -> QuantizedPages:
    if layer is not None:
        return quant.write_tokens(pages, x, slot_mapping, layer)
    return quant.write_tokens(pages[None], x, slot_mapping, 0)[0]


def _check_tokens(cache: KVCache, k, v, slot_mapping) -> None:
    expect = (cache.num_layers, None, cache.num_kv_heads, cache.head_dim)
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or any(e is not None and s != e for s, e in zip(x.shape, expect)):
            raise ValueError(
                f"{name}.shape={tuple(x.shape)} must be [num_layers={cache.num_layers}, num_tokens, "
                f"num_kv_heads={cache.num_kv_heads}, head_dim={cache.head_dim}]")
    if k.shape != v.shape:
        raise ValueError(f"k.shape={tuple(k.shape)} != v.shape={tuple(v.shape)}")
    if slot_mapping.ndim != 1 or slot_mapping.shape[0] != k.shape[1]:
        raise ValueError(f"slot_mapping.shape={tuple(slot_mapping.shape)} must be [num_tokens={k.shape[1]}]")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise TypeError(f"slot_mapping.dtype={slot_mapping.dtype} must be an integer type")


@functools.partial(jax.jit, donate_argnums=0)
def _write(cache, k, v, slot_mapping):
    def one(kp, vp, kl, vl):
        return write_layer(kp, vp, kl, vl, slot_mapping)

    k_pages, v_pages = jax.vmap(one)(cache.k_pages, cache.v_pages, k, v)
    return update_bounds(cache.replace(k_pages=k_pages, v_pages=v_pages), slot_mapping)


def update_bounds(cache: KVCache, slot_mapping: jax.Array) -> KVCache:
    """The cache with the keys just written at ``slot_mapping`` folded into their pages' bounds
    (traceable; a no-op without bounds). The jitted step calls it after the model's writes."""
    if cache.key_bounds is None:
        return cache
    bounds = page_select.update_bounds(cache.key_bounds, cache.k_pages, slot_mapping)
    return cache.replace(key_bounds=bounds)


def key_side(cache: KVCache):
    """What moves with a page's keys: ``k_pages``, ``(k_pages, key_bounds)`` with bounds, or
    ``(k_pages, key_bounds or None, attn_mass)`` with mass (page axis 2 in every leaf)."""
    if cache.attn_mass is not None:
        return cache.k_pages, cache.key_bounds, cache.attn_mass
    return cache.k_pages if cache.key_bounds is None else (cache.k_pages, cache.key_bounds)


def _with_key_side(cache: KVCache, k) -> KVCache:
    if cache.attn_mass is None and cache.key_bounds is None:
        return cache.replace(k_pages=k)
    return cache.replace(**dict(zip(("k_pages", "key_bounds", "attn_mass"), k)))


def write(
    cache: KVCache,
    k: jax.Array,  # [num_layers, num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_layers, num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[num_tokens]
) -> KVCache:
    """Writes every layer's K/V of new tokens at ``slot_mapping``. DONATES ``cache``.

    Raises:
      ValueError / TypeError: shapes or dtypes that do not match the cache.
    """
    _check_tokens(cache, k, v, jnp.asarray(slot_mapping))
    return _write(cache, k, v, jnp.asarray(slot_mapping, jnp.int32))


_TRACES = [0]  # traces of the page functions below (copy, read, write, poison): one compile each


def trace_count() -> int:
    """How many shapes the page copy / read / write / poison functions traced so far in this
    process (one XLA compilation each; the engine adds them to its ``num_compilations``)."""
    return _TRACES[0] + packed_cache.trace_count()


def _check_pages(cache: KVCache, name: str, pages) -> np.ndarray:
    arr = np.asarray(pages)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= cache.num_pages):
        raise ValueError(f"{name} has page ids outside [0, {cache.num_pages}): {arr.tolist()}")
    return arr.astype(np.int32)


def _map_pages(fn, cache: KVCache) -> KVCache:
    """``fn`` on every leaf with a page axis 2 (not the open pages: their axis 2 is a slot)."""
    k, v, b = jax.tree.map(fn, (cache.k_pages, cache.v_pages, cache.key_bounds))
    return cache.replace(k_pages=k, v_pages=v, key_bounds=b)


@functools.partial(jax.jit, donate_argnums=0)
def _copy_pages(cache, src, dst):
    _TRACES[0] += 1  # runs at trace time only
    return _map_pages(lambda x: x.at[:, :, dst].set(x[:, :, src]), cache)


def copy_pages(cache: KVCache, src, dst) -> KVCache:
    """Copy-on-write: page ``dst[i]`` becomes a copy of page ``src[i]`` in every layer. DONATES ``cache``.

    Args:
      cache: the cache (donated).
      src: i32[n] source pages. Padding entries are ``NULL_PAGE -> NULL_PAGE``.
      dst: i32[n] destination pages, distinct (except padding) and disjoint from ``src``.
    """
    src = _check_pages(cache, "src", src)
    dst = _check_pages(cache, "dst", dst)
    if src.shape != dst.shape:
        raise ValueError(f"src has {src.size} pages but dst has {dst.size}")
    real = dst != NULL_PAGE
    if len(set(dst[real].tolist())) != int(real.sum()) or set(dst[real].tolist()) & set(src.tolist()):
        raise ValueError(f"dst pages must be distinct and disjoint from src: src={src.tolist()} dst={dst.tolist()}")
    return _copy_pages(cache, jnp.asarray(pad_pages(src)), jnp.asarray(pad_pages(dst)))


@jax.jit
def _read_pages(cache, pages):
    _TRACES[0] += 1  # runs at trace time only
    return jax.tree.map(lambda x: x[:, :, pages], (key_side(cache), cache.v_pages))


def read_pages(cache: KVCache, pages):
    """Dispatches a copy of pages (the cache is not changed and not donated) and returns at once.

    Returns:
      ``(k, v)`` device arrays of shape ``[num_layers, num_kv_heads, n', page_size, head_dim]``
      (``QuantizedPages`` of values and scales for a quantized cache), ``n'`` the page count
      padded to a power of two: ``to_host`` of them waits for the copy. A step dispatched after
      this call on the same cache (donating it) is ordered after the read.
    """
    pages = _check_pages(cache, "pages", pages)
    return _read_pages(cache, jnp.asarray(pad_pages(pages)))


def to_host(pages, n: int):
    """The first ``n`` pages of ``read_pages``'s result as numpy (waits for the copy)."""
    return jax.tree.map(lambda x: np.asarray(x)[:, :, :n], pages)


def swap_out(cache: KVCache, pages):
    """Copies pages to host memory (the cache is not changed and not donated).

    Returns:
      ``(k, v)`` numpy arrays of shape ``[num_layers, num_kv_heads, n, page_size, head_dim]`` (for
      a quantized cache, ``QuantizedPages`` of numpy values and scales, ``n`` on axis 2 of both).
    """
    return to_host(read_pages(cache, pages), len(pages))


def host_buffers(cache: KVCache, num_blocks: int):
    """Zeroed host swap space for ``num_blocks`` pages: ``(host_k, host_v)``, numpy (pytrees of
    numpy for a quantized cache), the page axis 2 like the cache's."""
    if isinstance(cache.k_pages, packed.PackedPages):
        return (packed.host_zeros(cache.k_pages, num_blocks),
                packed.host_zeros(cache.v_pages, num_blocks))
    return (jax.tree.map(lambda x: quant.host_zeros(x, num_blocks), key_side(cache),
                         is_leaf=lambda x: isinstance(x, QuantizedPages)),
            quant.host_zeros(cache.v_pages, num_blocks))


def host_set(host, slots, pages) -> None:
    """``host[:, :, slots] = pages`` on every leaf (in place)."""
    def one(h, x):
        h[:, :, slots] = x

    jax.tree.map(one, host, pages)


def host_get(host, slots):
    """``host[:, :, slots]`` of every leaf (a copy)."""
    return jax.tree.map(lambda h: h[:, :, slots], host)


@functools.partial(jax.jit, donate_argnums=0)
def _write_pages(cache, pages, k, v):
    _TRACES[0] += 1  # runs at trace time only
    def put(x, new):
        return x.at[:, :, pages].set(new)

    cache = _with_key_side(cache, jax.tree.map(put, key_side(cache), k))
    return cache.replace(v_pages=jax.tree.map(put, cache.v_pages, v))


def swap_in(cache: KVCache, pages, k: np.ndarray, v: np.ndarray) -> KVCache:
    """Writes host copies back into (possibly different) pages. DONATES ``cache``.

    Args:
      cache: the cache (donated).
      pages: i32[n] destination pages.
      k, v: ``[num_layers, num_kv_heads, n, page_size, head_dim]`` from ``swap_out`` (pytrees of
        them, with scales, for a quantized cache).
    """
    pages = _check_pages(cache, "pages", pages)
    n = pages.size
    for name, x, like in (("k", k, key_side(cache)), ("v", v, cache.v_pages)):
        if jax.tree.structure(x) != jax.tree.structure(like):
            raise ValueError(f"{name} must have the structure of the cache's pages "
                             f"({jax.tree.structure(like)}), got {jax.tree.structure(x)}")
        for got, leaf in zip(jax.tree.leaves(x), jax.tree.leaves(like)):
            expect = (*leaf.shape[:2], n, *leaf.shape[3:])
            if tuple(got.shape) != expect:
                raise ValueError(f"{name}.shape={tuple(got.shape)} must be {expect}")
    padded = pad_pages(pages)
    extra = padded.size - n

    def prepare(x, leaf):
        # Padding rewrites the null page with zeros: harmless, nothing reads it.
        x = np.pad(x, [(0, 0), (0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 3))
        return jnp.asarray(x, leaf.dtype)

    k = jax.tree.map(prepare, k, key_side(cache))
    v = jax.tree.map(prepare, v, cache.v_pages)
    return _write_pages(cache, jnp.asarray(padded), k, v)


def gather_pages(cache: KVCache, pages):
    """Reads ``pages`` (i32[n], padded with ``NULL_PAGE`` to a power of two) into new device
    arrays on the cache's devices, the cache not donated (a later step that donates it is ordered
    after this read): the sending half of a hand-over (``paged.fleet.handover``). Returns
    ``(k, v)``: ``[num_layers, num_kv_heads, pad(n), page_size, head_dim]`` sharded as the cache
    (``QuantizedPages`` of values and scales for a quantized cache)."""
    pages = _check_pages(cache, "pages", pages)
    return _read_pages(cache, jnp.asarray(pad_pages(pages)))


def scatter_pages(cache: KVCache, pages, k, v) -> KVCache:
    """Writes ``gather_pages``' arrays (already on this cache's devices) into ``pages``: the
    receiving half of a hand-over. DONATES ``cache``.

    Args:
      cache: the cache (donated).
      pages: i32[n] destination pages, distinct; padded with ``NULL_PAGE`` to the length of the
        arrays (the padding rows land in the null page, which nothing reads).
      k, v: as ``gather_pages`` returns them, ``pad(n)`` pages on axis 2.

    Raises:
      ValueError: the arrays' page count is not ``pad(n)``, or their structure differs from the
        cache's pages.
    """
    pages = _check_pages(cache, "pages", pages)
    padded = pad_pages(pages)
    for name, x, like in (("k", k, key_side(cache)), ("v", v, cache.v_pages)):
        if jax.tree.structure(x) != jax.tree.structure(like):
            raise ValueError(f"{name} must have the structure of the cache's pages")
        for got, leaf in zip(jax.tree.leaves(x), jax.tree.leaves(like)):
            expect = (*leaf.shape[:2], padded.size, *leaf.shape[3:])
            if tuple(got.shape) != expect:
                raise ValueError(f"{name}.shape={tuple(got.shape)} must be {expect}")
    return _write_pages(cache, jnp.asarray(padded), k, v)


@functools.partial(jax.jit, donate_argnums=0)
def _poison(cache, pages):
    _TRACES[0] += 1  # runs at trace time only
    def nan(x):
        # int8 values cannot hold NaN: their scales (float32) can, and the product is NaN.
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.at[:, :, pages].set(jnp.array(jnp.nan, x.dtype))

    return _map_pages(nan, cache)


def poison(cache: KVCache, pages) -> KVCache:
    """Fills pages with NaN (debug mode: a stray read of a freed page spoils the output). DONATES ``cache``."""
    pages = _check_pages(cache, "pages", pages)
    return _poison(cache, jnp.asarray(pad_pages(pages)))


def gather(cache: KVCache, page_indices, length: int) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's KV as contiguous host arrays (for tests and debugging).

    Args:
      cache: the cache (not donated).
      page_indices: the sequence's pages in logical order.
      length: number of valid tokens; needs ``ceil(length / page_size)`` pages.

    Returns:
      ``(k, v)`` of shape ``[num_layers, length, num_kv_heads, head_dim]`` (float32, dequantized,
      for a quantized cache).
    """
    pages = _check_pages(cache, "page_indices", page_indices)
    if length < 0 or -(-length // cache.page_size) > pages.size:
        raise ValueError(f"length={length} needs more than the {pages.size} pages given "
                         f"(page_size={cache.page_size})")
    k, v = swap_out(cache, pages)  # [L, Hkv, n, page, D]
    if cache.key_bounds is not None or cache.attn_mass is not None:
        k = k[0]

    def flat(x):
        if isinstance(x, QuantizedPages):
            x = np.asarray(quant.dequantize(x))
        elif isinstance(x, packed.PackedPages):
            x = np.asarray(packed.dequantize(x))
        x = np.moveaxis(x, 1, 3)  # [L, n, page, Hkv, D]
        return x.reshape(x.shape[0], -1, x.shape[3], x.shape[4])[:, :length]

    return flat(k), flat(v)


def pad_pages(pages: np.ndarray) -> np.ndarray:
    """Pads a page list with ``NULL_PAGE`` to the next power of two (bounded recompilation)."""
    pages = np.asarray(pages, np.int32)
    out = np.full(next_pow2(pages.size), NULL_PAGE, np.int32)
    out[: pages.size] = pages
    return out

