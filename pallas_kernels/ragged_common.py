"""Host- and kernel-side helpers shared by the ragged kernels (TPU- and GPU-style).

The ragged kernels tile the token axis: grid step ``(h, qb)`` owns query rows
``[qb * bq, (qb + 1) * bq)`` of KV head ``h``, laid out as ``bq * G`` rows of ``D`` (token-major,
query head within its group minor). A tile may span several sequences; the kernel finds them with
two binary searches over ``cu_q_lens`` and visits each one's keys, masking rows of other sequences.
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
