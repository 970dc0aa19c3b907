"""The attention mass of the ``impl="xla"`` path (``mass_weight``, `pallas_kernels.api.MASS`):
a second pass over the keys a row's queries saw, once their softmax max and sum are known."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import quant, softmax


def _seen(pos, lo, limit):
    """Which keys ``pos`` each query sees: ``lo <= pos < limit``; ``lo`` may be ``(lo, hole_lo,
    hole_hi)`` (then keys in the hole are not seen)."""
    if isinstance(lo, tuple):
        lo, h0, h1 = lo
        return (pos < limit) & (pos >= lo) & ((pos < h0) | (pos >= h1))
    return (pos < limit) & (pos >= lo)


def attention_mass(qf, k_pages, row_pages, stats, weight, bounds, loop, *, sm_scale, soft_cap,
                   layer, pages_per_block, pages_per_seq, in_loop):  # fmt: skip
    """The second pass of :func:`paged_rows_attention` with ``mass_weight``: the probabilities
    need each query's final max and sum (``stats`` = ``(m, l)`` f32[Hkv, R, M]), so the keys are
    read again (keys only, no values: about the score half of the attention's work) and
    ``weight[r, m] * exp(s - m) / l`` is summed over the row's queries per key slot.

    ``bounds`` = ``(lo, limit)``, ``loop`` = ``(first, trips)`` and ``in_loop`` (the XLA:CPU
    2-byte gather barrier, ``xla._in_loop``) as in the first pass. Returns
    f32[R, Hkv, pages_per_seq * page] (slots in table order; slots no query sees are 0).
    """
    num_kv_heads, rows = qf.shape[:2]
    page_size = k_pages.shape[-2]
    block = pages_per_block * page_size
    m, lsum = stats
    lo, limit = bounds
    m = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]
    scale = (jnp.where(lsum > 0, 1.0 / jnp.where(lsum > 0, lsum, 1.0), 0.0)
             * jnp.asarray(weight, jnp.float32)[None])[..., None]  # [Hkv, R, M, 1]
    offsets = (np.arange(page_size)[:, None] + page_size * np.arange(pages_per_block)).reshape(-1)
    to_slot = np.argsort(offsets)  # (slot, page) order -> slot order
    offsets = jnp.asarray(offsets, jnp.int32)
    num_blocks = -(-pages_per_seq // pages_per_block)

    def body(i, buf):
        ids = lax.dynamic_slice_in_dim(row_pages, i * pages_per_block, pages_per_block, axis=1)
        def take(x):  # as in the first pass
            x = in_loop(x, ids)
            return x[:, ids] if layer is None else jnp.moveaxis(x[layer, :, ids], 2, 0)

        values, scales = quant.split(k_pages)
        g = quant.dequantize_tile(take(values), None if scales is None else take(scales))
        g = jnp.swapaxes(g, 2, 3).reshape(num_kv_heads, rows, block, qf.shape[-1])
        s = jnp.einsum("hrmd,hrkd->hrmk", qf, g)
        s = softmax.scale_scores(s, sm_scale=sm_scale, soft_cap=soft_cap)
        pos = i * block + offsets
        valid = _seen(pos, lo, limit)
        p = jnp.where(valid, jnp.exp(jnp.where(valid, s, 0.0) - m), 0.0) * scale
        col = jnp.sum(p, axis=2)[:, :, to_slot]  # [Hkv, R, block], slot order
        return lax.dynamic_update_slice_in_dim(buf, col, i * block, axis=2)

    buf = jnp.zeros((num_kv_heads, rows, num_blocks * block), jnp.float32)
    buf = lax.fori_loop(loop[0], loop[1], body, buf)
    return jnp.swapaxes(buf[:, :, :pages_per_seq * page_size], 0, 1)


__all__ = ["attention_mass"]
