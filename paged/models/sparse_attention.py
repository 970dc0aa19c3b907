"""Sparse decode in the attention layer: decode rows read only the pages Quest selects.

``SparseDecode`` rides on ``AttentionMetadata.sparse`` (the cache's key bounds and the static
budget). In a step, a row that is its sequence's only new token (a decode, or a one-token
prefill chunk) attends through ``pallas_kernels.page_select.sparse_paged_attention``; every
other row (prefill chunks) through the ordinary ragged kernel, which then reads one token of
each decode sequence (its own row is replaced) and is skipped when the step has no prefill row.
The first ``dense_layers`` layers select nothing: every row reads every page there (Quest).
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from pallas_kernels import page_select


@flax.struct.dataclass
class SparseDecode:
    """What a step's attention needs to select pages.

    Attributes:
      bounds: the cache's ``key_bounds`` as the step began (``[L, Hkv, P, 2, D]``); a decode
        row's own page is the last one, always read, so bounds missing this step's token do not
        change any selection.
      budget: pages per row (an int) or a fraction of each row's pages (a float); static.
      dense_layers: layers ``< dense_layers`` read every page (the ordinary ragged kernel).
      gqa: how a query group picks its pages (``page_select.select_pages``); static.
      recent: pages before the open page always read, inside the budget
        (``page_select.select_pages``); static.
    """

    bounds: jax.Array  # [L, Hkv, P, 2, D]
    budget: float = flax.struct.field(pytree_node=False)
    dense_layers: int = flax.struct.field(pytree_node=False, default=0)
    gqa: str = flax.struct.field(pytree_node=False, default="max")
    recent: int = flax.struct.field(pytree_node=False, default=0)


def decode_rows(md):
    """``(decode bool[S], rows i32[S])``: which sequence slots have one new token, and its row."""
    cu = md.cu_q_lens
    live = jnp.arange(md.kv_lens.shape[0]) < md.num_seqs[0]
    decode = live & (cu[1:] - cu[:-1] == 1)
    prefill = live & (cu[1:] - cu[:-1] > 1)
    return decode, prefill, cu[:-1]


def attend(q, k_pages, v_pages, md, *, layer, sm_scale, soft_cap, impl):
    """Attention of a step's rows ``q [T, Hq, D]`` with sparse decode rows (module docstring).
    ``layer``: an int, or traced (stacked layers): then a ``lax.cond`` picks the dense path in
    the first ``dense_layers`` layers."""
    import pallas_kernels as pk

    def every_page(_):
        return pk.ragged_paged_attention(
            q, k_pages, v_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=sm_scale, soft_cap=soft_cap, impl=impl, layer=layer)

    def selected(_):
        return _selected(q, k_pages, v_pages, md, layer=layer, sm_scale=sm_scale,
                         soft_cap=soft_cap, impl=impl)

    n = md.sparse.dense_layers
    if n == 0 or layer is None:  # layer None: one layer's pages, no index to compare
        return selected(None)
    if isinstance(layer, int):
        return every_page(None) if layer < n else selected(None)
    return jax.lax.cond(layer < n, every_page, selected, None)


def _selected(q, k_pages, v_pages, md, *, layer, sm_scale, soft_cap, impl):
    import pallas_kernels as pk

    num_tokens = q.shape[0]
    decode, prefill, first = decode_rows(md)
    rows = jnp.minimum(first, num_tokens - 1)
    sparse = page_select.sparse_paged_attention(
        q[rows], k_pages, v_pages, md.sparse.bounds, md.kv_lens, md.page_indices, decode,
        budget=md.sparse.budget, sm_scale=sm_scale, soft_cap=soft_cap, impl=impl, layer=layer,
        gqa=md.sparse.gqa, recent=md.sparse.recent)

    def dense(_):
        kv_lens = jnp.where(decode, 1, md.kv_lens)  # decode rows: one token, replaced below
        return pk.ragged_paged_attention(
            q, k_pages, v_pages, kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=sm_scale, soft_cap=soft_cap, impl=impl, layer=layer)

    out = jax.lax.cond(jnp.any(prefill), dense, lambda _: jnp.zeros_like(q), None)
    return out.at[jnp.where(decode, rows, num_tokens)].set(sparse.astype(out.dtype), mode="drop")


__all__ = ["SparseDecode", "attend", "decode_rows"]
