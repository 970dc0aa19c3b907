"""Seeded on-device sampling: greedy / temperature / top-k / top-p, log-probabilities, and the
speculative verify and draft samplers.

A request's randomness comes only from ``(seed, sample_index, position)``: the key for the token at
position ``p`` of sample ``j`` is ``fold_in(fold_in(PRNGKey(seed), j), p)``. So a request samples
the same tokens whether it runs alone or inside any batch, and after a recompute preemption.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged.request.sampling import MAX_LOGPROBS


def _filter_sorted(logits, temperature, top_k, top_p):
    """Temperature-scaled logits sorted descending, their vocabulary order, and which of them
    top-k and top-p keep (the most likely always)."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(vocab)
    keep = rank < jnp.where(top_k > 0, top_k, vocab)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    mass_before = jnp.cumsum(probs) - probs
    keep &= (mass_before < top_p) | (rank == 0)
    return order, sorted_logits, keep


def _sample_one(logits, temperature, top_k, top_p, seed, sample_index, position):
    """Samples one token from one row of logits (vmapped; every row independent of the others)."""
    greedy = jnp.argmax(logits).astype(jnp.int32)
    order, sorted_logits, keep = _filter_sorted(logits, temperature, top_k, top_p)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), sample_index), position)
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))
    sampled = order[choice].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def sample(
    logits: jax.Array,  # f32[N, V]
    temperature: jax.Array,  # f32[N]
    top_k: jax.Array,  # i32[N]
    top_p: jax.Array,  # f32[N]
    seed: jax.Array,  # i32[N]
    sample_index: jax.Array,  # i32[N]
    position: jax.Array,  # i32[N]: position of the token being sampled
) -> jax.Array:  # i32[N]
    """Greedy / temperature / top-k / top-p sampling, one independent key per row (traceable).

    A batch whose every row is greedy (temperature 0; padding rows are) takes the argmax alone:
    the same tokens without a vocabulary sort and a random draw per row.
    """
    logits = logits.astype(jnp.float32)
    return jax.lax.cond(
        jnp.all(temperature <= 0), lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
        lambda: jax.vmap(_sample_one)(logits, temperature, top_k, top_p, seed, sample_index,
                                      position))


def logprobs(logits: jax.Array, tokens: jax.Array, k: int = MAX_LOGPROBS):
    """Log-softmax of each row of ``logits`` (f32[N, V]): the log-probability of ``tokens[i]``
    (i32[N]) in row i, and the row's ``k`` largest log-probabilities with their token ids."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return picked, top_ids.astype(jnp.int32), top_lp


def _filtered_probs(logits, temperature, top_k, top_p):
    """The distribution ``_sample_one`` samples from, in vocabulary order (one-hot when greedy)."""
    vocab = logits.shape[-1]
    order, sorted_logits, keep = _filter_sorted(logits, temperature, top_k, top_p)
    p_sorted = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    probs = jnp.zeros(vocab, jnp.float32).at[order].set(p_sorted)
    greedy = jax.nn.one_hot(jnp.argmax(logits), vocab, dtype=jnp.float32)
    return jnp.where(temperature > 0, probs, greedy)


def _key(seed, sample_index, position, stream):
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
        jax.random.PRNGKey(seed), sample_index), position), stream)


def _verify_one(logits, temperature, top_k, top_p, seed, sample_index, position, draft, q):
    """One verify slot: accept ``draft`` with probability min(1, p(draft) / q(draft)), else
    sample from norm(max(0, p - q)); ``draft < 0``: a plain sample. ``q`` is the distribution the
    draft was drawn from (a point mass at it for n-gram proposals)."""
    plain = _sample_one(logits, temperature, top_k, top_p, seed, sample_index, position)
    probs = _filtered_probs(logits.astype(jnp.float32), temperature, top_k, top_p)
    k_accept, k_residual = jax.random.split(_key(seed, sample_index, position, 1))
    d = jnp.maximum(draft, 0)
    ratio = probs[d] / jnp.maximum(q[d], 1e-30)
    accept = (draft >= 0) & (jax.random.uniform(k_accept) < jnp.minimum(1.0, ratio))
    residual = jnp.maximum(probs - q, 0.0)
    resampled = jax.random.categorical(
        k_residual, jnp.where(residual > 0, jnp.log(jnp.maximum(residual, 1e-38)), -jnp.inf))
    resampled = jnp.where(residual.sum() > 0, resampled, plain).astype(jnp.int32)
    token = jnp.where(draft < 0, plain, jnp.where(accept, d, resampled))
    return token.astype(jnp.int32), accept


def verify(logits, temperature, top_k, top_p, seed, sample_index, position, draft, q=None,
           q_index=None):
    """``sample`` for verify rows: per slot, the emitted token and whether its draft
    (``draft`` i32[N], -1 where none) was accepted, by the speculative rejection rule. ``q``
    (f32[M, V]) and ``q_index`` (i32[N], -1: a point mass at the draft) give each slot's draft
    distribution; without them every draft is a point mass (n-gram proposals).

    A batch whose every row is greedy takes the rule's greedy form directly: p is a point mass at
    the argmax, so a draft is accepted exactly when it is the argmax, and the emitted token is the
    argmax either way (the same tokens and accept bits, without sorts and draws).
    """
    vocab = logits.shape[-1]
    logits = logits.astype(jnp.float32)

    def greedy():
        top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return top, (draft >= 0) & (draft == top)

    def general():
        point = jax.nn.one_hot(jnp.maximum(draft, 0), vocab, dtype=jnp.float32)
        if q is None:
            qs = point
        else:
            qs = jnp.where((q_index >= 0)[:, None], q[jnp.maximum(q_index, 0)], point)
        return jax.vmap(_verify_one)(logits, temperature, top_k, top_p, seed, sample_index,
                                     position, draft, qs)

    return jax.lax.cond(jnp.all(temperature <= 0), greedy, general)


def draft_sample(logits, temperature, top_k, top_p, seed, sample_index, position):
    """A draft model's proposal per row and the filtered distribution it was drawn from (its own
    random stream, apart from the target's), f32[N, V]."""
    def one(lg, t, k, p, s, j, pos):
        probs = _filtered_probs(lg, t, k, p)
        tok = jax.random.categorical(
            _key(s, j, pos, 2), jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf))
        return tok.astype(jnp.int32), probs

    return jax.vmap(one)(logits.astype(jnp.float32), temperature, top_k, top_p, seed,
                         sample_index, position)
