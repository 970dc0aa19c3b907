"""Row tiling shared by the TPU- and GPU-style kernels (host-side layout and in-kernel masks).

The ragged and flash kernels tile the token axis: a tile holds ``bq`` tokens times the ``G`` query
heads of one KV head, laid out as ``bq * G`` rows of ``D`` (token-major, query head within its
group minor; ``G`` padded to ``Gp`` where a backend wants powers of two). A ragged tile may span
several sequences; the kernel finds them with two binary searches over ``cu_q_lens``
(:func:`tile_sequences`) and visits each one's keys, masking rows of other sequences
(:func:`sequence_in_tile`). Nothing here names a backend: both styles import it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def lower_bound(lo, hi, is_before):
    """Smallest ``s`` in ``[lo, hi)`` with ``not is_before(s)`` (``hi`` if none); ``is_before``
    must be true on a prefix of the range."""

    def body(c):
        lo, hi = c
        mid = (lo + hi) // 2
        right = is_before(mid)
        return jnp.where(right, mid + 1, lo), jnp.where(right, hi, mid)

    return lax.while_loop(lambda c: c[0] < c[1], body, (lo, hi))[0]


def tile_sequences(cu_ref, lo, hi, row0, block_q):
    """``(first, last)``: the sequences in ``[lo, hi)`` that own query rows in
    ``[row0, row0 + block_q)``."""
    first = lower_bound(lo, hi, lambda s: cu_ref[s + 1] <= row0)
    last = lower_bound(first, hi, lambda s: cu_ref[s] < row0 + block_q)
    return first, last


def sequence_in_tile(q_start, q_end, kv_len, token, *, row0, block_q, max_keys,
                     sliding_window=None):
    """What sequence ``s`` (query rows ``[q_start, q_end)``, ``kv_len`` keys) means for one tile.

    ``token`` holds the token row of each tile row (any shape). Returns ``(start, limit,
    visible)``: ``limit`` the keys the tile's last row of ``s`` may see (causal; 0 when no row of
    the tile belongs to ``s``), capped at ``max_keys``; ``start`` the first key its first row may
    see (0 without ``sliding_window``; ``first row's position + 1 - W`` with it, so pages wholly
    below it are skipped); ``visible(key)`` the mask of keys each row sees (false on rows of other
    sequences; with a window, keys ``[p - W + 1, p]`` of the row at position ``p``), ``key``
    broadcastable against ``token``.
    """
    tile_start = jnp.maximum(q_start, row0)
    tile_end = jnp.minimum(q_end, row0 + block_q)
    limit = jnp.clip(kv_len - q_end + tile_end, 0, max_keys)
    limit = jnp.where(tile_end > tile_start, limit, 0)
    row_ok = (token >= q_start) & (token < q_end)
    row_limit = kv_len - q_end + token + 1
    if sliding_window is None:
        return jnp.int32(0), limit, lambda key: row_ok & (key < row_limit)
    start = jnp.clip(kv_len - q_end + tile_start + 1 - sliding_window, 0, limit)
    row_start = row_limit - sliding_window
    return start, limit, lambda key: row_ok & (key < row_limit) & (key >= row_start)


def tile_queries(
    q: jax.Array,  # [T, Hq, D]
    num_kv_heads: int,
    group_padded: int,
    block_q: int,
) -> jax.Array:  # [Hkv, T_pad * Gp, D]
    """Pads tokens to a multiple of ``block_q`` and heads-per-group to ``group_padded``."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    t_pad = -(-num_tokens // block_q) * block_q
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, t_pad - num_tokens), (0, 0), (0, group_padded - group), (0, 0)))
    return jnp.swapaxes(q4, 0, 1).reshape(num_kv_heads, t_pad * group_padded, head_dim)


def untile_outputs(
    o: jax.Array,  # [Hkv, T_pad * Gp, D]
    num_tokens: int,
    group: int,
    group_padded: int,
) -> jax.Array:  # [T, Hkv * G, D]
    """Inverse of :func:`tile_queries` (drops padded tokens and heads)."""
    num_kv_heads, _, head_dim = o.shape
    o4 = o.reshape(num_kv_heads, -1, group_padded, head_dim)[:, :num_tokens, :group]
    return jnp.swapaxes(o4, 0, 1).reshape(num_tokens, num_kv_heads * group, head_dim)


def num_seqs_array(num_seqs) -> jax.Array:  # i32[1]
    """Accepts a Python int or an i32[1] / scalar array."""
    return jnp.asarray(num_seqs, jnp.int32).reshape(1)


def pad_axis(x, axis: int, multiple: int):
    """``x`` zero-padded at the end of ``axis`` to a multiple of ``multiple``."""
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def flash_layout(q, k, v, kv_lens, *, num_kv_heads, group_padded, block_q, block_k):
    """The flash kernels' operands: ``(lens, q3, kt, vt)``.

    ``q3`` ``[B, Hkv, Tq_pad * Gp, D]`` (:func:`tile_queries` per batch entry), ``kt``/``vt``
    ``[B, Hkv, Tk_pad, D]`` (one transposing copy: both styles tile a head's keys contiguously),
    ``lens`` i32[B] valid keys (default: all), capped at ``Tk``.
    """
    batch, kv_len = k.shape[0], k.shape[1]
    lens = jnp.full((batch,), kv_len, jnp.int32) if kv_lens is None else kv_lens
    lens = jnp.minimum(jnp.asarray(lens, jnp.int32), kv_len)
    q3 = jax.vmap(lambda x: tile_queries(x, num_kv_heads, group_padded, block_q))(jnp.asarray(q))
    kt, vt = (jnp.swapaxes(pad_axis(jnp.asarray(x), 1, block_k), 1, 2) for x in (k, v))
    return lens, q3, kt, vt


def flash_untile(out, q_len: int, group: int, group_padded: int):
    """``[B, Hkv, Tq_pad * Gp, D]`` kernel output -> ``[B, Tq, Hkv * G, D]``."""
    return jax.vmap(lambda o: untile_outputs(o, q_len, group, group_padded))(out)


def row_limit(kv_len, token, *, q_len: int, causal: bool):
    """Keys ``[0, limit)`` query ``token`` sees: causal ``kv_len - q_len + token + 1``, capped."""
    if not causal:
        return jnp.broadcast_to(kv_len, jnp.shape(token))
    return jnp.minimum(kv_len - q_len + token + 1, kv_len)


def tile_key_end(kv_len, qi, block_q, *, q_len: int, causal: bool):
    """Exclusive end of the keys any query of flash tile ``qi`` sees."""
    return jnp.maximum(row_limit(kv_len, (qi + 1) * block_q - 1, q_len=q_len, causal=causal), 0)
