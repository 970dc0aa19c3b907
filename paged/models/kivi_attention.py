"""One layer's attention over packed (int4 / int2, KIVI) pages with quantize-on-fill.

The cache of a packed engine is a packed pool (``pallas_kernels.packed.PackedPages``, keys per
channel, values per token) plus the open-page buffer (the model dtype, one page per slot, see
``paged.kv.open_pages``; an open page's head lives in its pool page's value bytes, its tail in
its slot, ``paged.kv.packed_cache``). Through the model both travel as :class:`KiviPages` (in
place of the ``k_pages`` / ``v_pages`` arrays), so the layers thread them unchanged.

Per layer and step (:func:`attend`), with ``src`` = the layer's open buffer followed by the
step's new K/V rows (the indices of ``md.kivi``, :class:`KiviMeta`, address it):

1. the pages that fill in this step are gathered from ``src``, quantized and written into the
   packed pool (``close_dst``): a row later in the same chunk reads them packed, as every later
   step does;
2. each token row attends to its closed pages (read packed and dequantized tile by tile inside
   ``pallas_kernels.kivi.paged_attention``) plus its own open page in full precision
   (``open_src``): the query at position ``t`` reads the pages full at ``t`` quantized and the
   rest exactly, ``pallas_kernels.kivi.dense_on_fill``'s semantics;
3. the new rows whose page stays open are written into their open pages (``open_dst``): each
   written slot's head back into its pool page (``slot_write``), its tail into the open buffer.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import kivi, packed
from pallas_kernels.packed import PackedPages


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KiviPages:
    """A packed pool and its open-page buffer, threaded through the model as one pytree."""

    pool: PackedPages  # values u8[L, Hkv, P, page, D*bits/8]; scale/zero f16[L, Hkv, P, W]
    # [L, Hkv, num_slots, page * D - E] in the model dtype: each open page's tail (its first E
    # elements live in its pool page's value bytes, ``paged.kv.packed_cache``)
    open: jax.Array

    shape = property(lambda self: self.pool.shape)  # logical [L, Hkv, P, page, D]
    ndim = property(lambda self: self.pool.ndim)


@flax.struct.dataclass
class KiviMeta:
    """Index arrays of one step (``paged.kv.open_pages.OpenPages.plan``)."""

    row_len: jax.Array  # i32[T]: keys each token row attends to (0: padding)
    row_seq: jax.Array  # i32[T]: the row's sequence (its block-table row)
    open_src: jax.Array  # i32[T, page]: source of each offset of the row's open page
    open_dst: jax.Array  # i32[T]: open-buffer index of the row's new K/V (out of range: dropped)
    close_dst: jax.Array  # i32[C]: pages that fill in this step (NULL_PAGE: padding)
    close_src: jax.Array  # i32[C, page]: sources of their tokens
    slot_page: jax.Array  # i32[S]: pool page of each slot's open page as the step starts
    slot_write: jax.Array  # i32[S]: pool page of each slot written in this step (else dropped)


def open_pages(pages: KiviPages, layer, slot_page) -> jax.Array:  # -> [Hkv, S, page, D]
    """Every slot's whole open page of layer ``layer`` in the model dtype: its head read back
    bit for bit from the value bytes of pool page ``slot_page[slot]`` (``i32[S]``), then its tail
    from the open buffer."""
    tail = pages.open[layer]  # [Hkv, S, R]
    h, slots, _ = tail.shape
    _, page, d = pages.shape[-3:]
    raw = pages.pool.values[layer][:, slot_page]  # u8[Hkv, S, page, Dp]
    item = jnp.dtype(tail.dtype).itemsize
    head = lax.bitcast_convert_type(raw.reshape(h, slots, -1, item), tail.dtype)  # [Hkv, S, E]
    return jnp.concatenate([head, tail], axis=-1).reshape(h, slots, page, d)


def _update(pages: KiviPages, new, meta: KiviMeta, layer):
    """``(pool, open buffer, open rows f[T, Hkv, page, D])`` after this layer's writes: the pages
    that fill are quantized into the pool, then the written slots' heads are stored back into
    their pool pages' value bytes and their tails into the open buffer."""
    buf = pages.open
    h, slots = buf.shape[1:3]
    page, d = pages.shape[-2:]
    full = open_pages(pages, layer, meta.slot_page).reshape(h, slots * page, d)
    src = jnp.concatenate([full, jnp.swapaxes(new, 0, 1).astype(buf.dtype)],
                          axis=1)  # [Hkv, S*p+T, D]
    pool = pages.pool
    q = packed.quantize_pages(src[:, meta.close_src], pool.bits, pool.per)  # [Hkv, C, page, ..]
    put = lambda x, v: x.at[layer, :, meta.close_dst].set(jnp.swapaxes(v, 0, 1))
    values = put(pool.values, q.values)
    rows = jnp.swapaxes(src[:, meta.open_src], 0, 1)  # [T, Hkv, page, D]
    full = full.at[:, meta.open_dst].set(new.astype(buf.dtype).swapaxes(0, 1), mode="drop")
    full = full.reshape(h, slots, page * d)
    e = page * d - buf.shape[-1]
    head = lax.bitcast_convert_type(full[..., :e], jnp.uint8)  # [Hkv, S, E, itemsize]
    head = jnp.swapaxes(head.reshape(h, slots, page, -1), 0, 1)  # [S, Hkv, page, Dp]
    values = values.at[layer, :, meta.slot_write].set(head, mode="drop")
    pool = PackedPages(values, put(pool.scale, q.scale), put(pool.zero, q.zero), pool.bits,
                       pool.per)
    return pool, buf.at[layer].set(full[..., e:]), rows


def attend(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D] the step's new keys
    v: jax.Array,  # [T, Hkv, D] the step's new values
    k_pages: KiviPages,
    v_pages: KiviPages,
    md,  # AttentionMetadata with ``kivi`` (KiviMeta)
    *,
    layer,
    sm_scale: float,
    soft_cap: float | None,
    impl: str,
) -> tuple[jax.Array, KiviPages, KiviPages]:  # ([T, Hq, D], k_pages, v_pages)
    """Closes the pages that fill, attends, writes the open rows (module docstring)."""
    meta = md.kivi
    kpool, kopen, krows = _update(k_pages, k, meta, layer)
    vpool, vopen, vrows = _update(v_pages, v, meta, layer)
    out = kivi.paged_attention(q, kpool, vpool, krows, vrows, meta.row_len,
                               md.page_indices[meta.row_seq], sm_scale=sm_scale,
                               soft_cap=soft_cap, impl=impl, layer=layer)
    return out, KiviPages(kpool, kopen), KiviPages(vpool, vopen)


__all__ = ["KiviMeta", "KiviPages", "attend", "open_pages"]
