"""The online softmax every blocked implementation shares: the XLA path and both Pallas styles.

Plain ``jnp`` on values (never refs), so the same functions run inside TPU-style (Mosaic) and
GPU-style (Triton) kernel bodies, in interpret mode and in the jnp XLA path. The state of a row set
is ``(m, l, acc)``: running max, running sum of ``exp(s - m)`` and the unnormalised accumulator
``sum p @ v``, all float32. ``m``/``l`` are either ``[..., R]`` (register style) or ``[..., R, 1]``
(VMEM-scratch style, what Mosaic tiles); every function accepts both.

Rows that have seen no valid key keep ``m = -inf`` and ``l = 0`` and contribute nothing; the final
:func:`normalize` maps them to zeros. Masking is by ``jnp.where`` (never by multiplying), so NaN
stored at a masked score position cannot reach the output; masked *value* rows are the caller's
to zero (``0 * NaN`` is NaN), since only the caller knows which rows hold data.
"""

from __future__ import annotations

import jax.numpy as jnp


def scale_scores(s, *, sm_scale: float, soft_cap: float | None):
    """``s * sm_scale``, then ``soft_cap * tanh(s / soft_cap)`` when ``soft_cap`` is set."""
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def _column(x, state_dim: int, score_dim: int):
    """``x`` (``m``/``l``/``alpha``) shaped to broadcast against ``[..., R, K]`` scores."""
    return x if state_dim == score_dim else x[..., None]


def initial_state(rows: tuple[int, ...], head_dim: int, *, keepdims: bool = False):
    """``(m, l, acc)`` before any key: ``-inf``, ``0``, ``0`` (float32).

    ``rows`` is the batch-and-row shape of the scores without the key axis; ``keepdims`` gives
    ``m``/``l`` a trailing axis of 1.
    """
    stat = (*rows, 1) if keepdims else tuple(rows)
    return (
        jnp.full(stat, -jnp.inf, jnp.float32),
        jnp.zeros(stat, jnp.float32),
        jnp.zeros((*rows, head_dim), jnp.float32),
    )


def _einsum_pv(p, v):
    return jnp.einsum("...gk,...kd->...gd", p, v)


def online_softmax_step(state, s, v, valid, *, pv=_einsum_pv):
    """Folds one tile of keys into ``state = (m, l, acc)``; returns the new state.

    Args:
      state: ``m`` and ``l`` f32 ``[..., R]`` or ``[..., R, 1]``, ``acc`` f32 ``[..., R, D]``.
      s: f32 ``[..., R, K]`` scores of the tile, already scaled and capped
        (:func:`scale_scores`).
      v: ``[..., K, D]`` values of the tile, rows that hold no data already zeroed.
      valid: bool, broadcastable to ``s``: the keys each row may see.
      pv: ``(p, v) -> [..., R, D]`` float32, the probabilities-times-values product (a backend's
        own dot: precision, operand dtype); default ``einsum("...gk,...kd->...gd")``.
    """
    m, lsum, acc = state
    keep = m.ndim == s.ndim
    s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=keep))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - _column(m_safe, m.ndim, s.ndim))
    lsum = alpha * lsum + jnp.sum(p, axis=-1, keepdims=keep)
    acc = _column(alpha, m.ndim, s.ndim) * acc + pv(p, v)
    return m_new, lsum, acc


def normalize(lsum, acc):
    """``acc / l`` per row: the attention output of the state (zeros where ``l == 0``)."""
    den = jnp.where(lsum == 0.0, 1.0, lsum)
    return acc / (den if den.ndim == acc.ndim else den[..., None])


def combine_states(o, m, lsum):
    """Combines states computed over disjoint key ranges into one state, still unnormalised.

    ``o`` f32 ``[S, ..., D]`` accumulators, ``m`` / ``lsum`` f32 ``[S, ...]``; returns the state
    ``(m, l, acc)`` of the union of the ranges (``[...]``, ``[...]``, ``[..., D]``), exactly the
    state one pass over all the keys would have reached (up to float rounding). Empty states
    (``m = -inf``) weigh 0; all-empty rows stay empty.
    """
    m_max = jnp.max(m, axis=0)
    m_safe = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    w = jnp.exp(m - m_safe[None])
    return m_max, jnp.sum(lsum * w, axis=0), jnp.sum(o * w[..., None], axis=0)


def merge_partials(o, m, lsum):
    """Combines states computed over disjoint key ranges (split-K) and normalises.

    ``o`` f32 ``[S, ..., D]`` unnormalised accumulators, ``m`` / ``lsum`` f32 ``[S, ...]``; returns
    f32 ``[..., D]``. Empty partitions (``m = -inf``) weigh 0.
    """
    _, lsum, acc = combine_states(o, m, lsum)
    return normalize(lsum, acc)
