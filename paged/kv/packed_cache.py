"""The device side of packed (int4 / int2, KIVI) caches: the packed pool with its open-page
buffers, the copy of open-page slots that copy-on-write of an open page needs, and the open
pages' trip to the host and back with a swapped sequence.

**An open page is held once.** Its pool page is allocated with its first token (as every page)
but holds no quantized values until the page fills; so the open page's first
:func:`head_elems` elements (the page ``[page, D]`` flattened, in the model dtype) are stored
*in the pool page's value bytes*, bit for bit, and only the rest in its slot of the open-page
buffer (``[L, Hkv, num_slots, page * D - head_elems]``). A slot costs a model-dtype page less
the packed page's value bytes (``ModelSpec.open_page_bytes``), and the head travels with the pool
page through everything that moves pages (copy-on-write, swap, hand-over) for free.

``KVCache.create`` builds a packed cache with :func:`zeros`; the engine copies slots with
:func:`copy_open_slots` (slots planned by ``paged.kv.open_pages.OpenPages.copy``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged.kv.paging import next_pow2
from pallas_kernels import packed

_TRACES = [0]  # traces of the slot copy (one compile each)


def trace_count() -> int:
    """Shapes :func:`copy_open_slots` traced so far in this process."""
    return _TRACES[0]


def head_elems(bits: int, page_size: int, head_dim: int, dtype) -> int:
    """Elements of an open page (flattened ``[page, D]``, in ``dtype``) held in its pool page's
    value bytes (``page * D * bits / 8`` bytes).

    Raises:
      ValueError: those bytes are not a whole number of ``dtype`` elements.
    """
    size, item = page_size * head_dim * bits // 8, jnp.dtype(dtype).itemsize
    if size % item:
        raise ValueError(f"{bits}-bit pages of block_size={page_size} x head_dim={head_dim} hold "
                         f"{size} value bytes, not a whole number of {jnp.dtype(dtype).name} "
                         f"elements: the open page's head cannot live there")
    return size // item


def zeros(kv_cache_dtype: str, shape: tuple[int, ...], dtype, open_slots: int, sharding=None):
    """``(k_pages, v_pages, open_k, open_v)`` of a zeroed packed cache of logical ``shape``
    ``[L, Hkv, P, page, D]``: keys per channel, values per token (``PackedPages``), and
    ``open_slots`` open-page tails ``[L, Hkv, open_slots, page * D - head_elems]`` in ``dtype``
    (None when 0; the module docstring).

    Raises:
      ValueError: a head dim that does not pack into bytes, a page shorter than 2 tokens, or
        value bytes that do not hold whole ``dtype`` elements.
    """
    num_layers, num_kv_heads, _, page_size, head_dim = shape
    packed.check_dims(kv_cache_dtype, page_size, head_dim)
    bits = packed.bits_of(kv_cache_dtype)
    tail = page_size * head_dim - head_elems(bits, page_size, head_dim, dtype)
    k_zeros, v_zeros = (functools.partial(packed.zeros, shape, bits, per)
                        for per in ("channel", "token"))
    open_zeros = functools.partial(
        jnp.zeros, (num_layers, num_kv_heads, open_slots, tail), dtype)
    if sharding is not None:  # every leaf has the KV heads on axis 1
        k_zeros, v_zeros, open_zeros = (jax.jit(z, out_shardings=sharding)
                                        for z in (k_zeros, v_zeros, open_zeros))
    opened = (open_zeros(), open_zeros()) if open_slots else (None, None)
    return k_zeros(), v_zeros(), *opened


@functools.partial(jax.jit, donate_argnums=0)
def _copy_slots(cache, src, dst):
    _TRACES[0] += 1  # runs at trace time only
    put = lambda x: x.at[:, :, dst].set(x[:, :, src], mode="drop")
    return cache.replace(open_k=put(cache.open_k), open_v=put(cache.open_v))


def copy_open_slots(cache, pairs):
    """Open-page slot ``dst`` of ``cache`` (a ``KVCache``) becomes a copy of slot ``src`` for
    each ``(src, dst)``. DONATES ``cache``; padded to a power of two with pairs whose ``dst``
    is out of range (dropped)."""
    if not pairs:
        return cache
    src, dst = (np.asarray(x, np.int32) for x in zip(*pairs))
    pad = next_pow2(src.size) - src.size
    src = np.pad(src, (0, pad))
    dst = np.pad(dst, (0, pad), constant_values=cache.open_k.shape[2])
    return _copy_slots(cache, jnp.asarray(src), jnp.asarray(dst))


def save_swapped(cache, open_pages, swap_out) -> None:
    """The open pages among ``swap_out`` ``(page, host_slot)`` pairs go to the host with their
    pages (held by ``open_pages``, a ``paged.kv.open_pages.OpenPages``, by host slot)."""
    pairs = open_pages.swap_out(swap_out)
    if pairs:
        slots, hosts = (list(x) for x in zip(*pairs))
        idx = jnp.asarray(slots, jnp.int32)
        open_pages.keep(hosts, np.asarray(cache.open_k[:, :, idx]),
                        np.asarray(cache.open_v[:, :, idx]))


def load_swapped(cache, open_pages, swap_in):
    """Writes the open pages among ``swap_in`` ``(host_slot, page)`` pairs back into fresh slots
    (``cache`` replaced, not donated)."""
    slots, ks, vs = open_pages.swap_in(swap_in)
    if not slots:
        return cache
    idx = jnp.asarray(slots, jnp.int32)
    put = lambda x, new: x.at[:, :, idx].set(jnp.asarray(np.stack(new, axis=2), x.dtype))
    return cache.replace(open_k=put(cache.open_k, ks), open_v=put(cache.open_v, vs))
