"""Paged KV cache: device state as a pytree, changed only by pure jitted functions.

Layout (the one of JAX's own Pallas paged-attention kernels, layers stacked in front)::

    k_pages, v_pages: [num_layers, num_kv_heads, num_pages, page_size, head_dim]

Page ``NULL_PAGE`` (0) is the null page: page-table padding points at it and padded tokens write
into it. It is never handed to a sequence, so its content is garbage by design and nothing may read it
for a real position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NULL_PAGE = 0


def write_layer(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[num_tokens]: page * page_size + offset
) -> tuple[jax.Array, jax.Array]:
    """Scatters one layer's new K/V into its pages (traceable; use inside a jitted step).

    Padded tokens must carry a slot inside ``NULL_PAGE`` (0 .. page_size-1).
    """
    hkv, num_pages, page_size, d = k_pages.shape
    flat_k = k_pages.reshape(hkv, num_pages * page_size, d)
    flat_v = v_pages.reshape(hkv, num_pages * page_size, d)
    kt = jnp.swapaxes(k, 0, 1).astype(k_pages.dtype)  # [Hkv, T, D]
    vt = jnp.swapaxes(v, 0, 1).astype(v_pages.dtype)
    flat_k = flat_k.at[:, slot_mapping].set(kt, mode="drop")
    flat_v = flat_v.at[:, slot_mapping].set(vt, mode="drop")
    return flat_k.reshape(k_pages.shape), flat_v.reshape(v_pages.shape)
