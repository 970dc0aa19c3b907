"""Sampling parameters (host) and seeded on-device sampling.

A request's randomness comes only from ``(seed, sample_index, position)``: the key for the token at
position ``p`` of sample ``j`` is ``fold_in(fold_in(PRNGKey(seed), j), p)``. So a request samples
the same tokens whether it runs alone or inside any batch, and after a recompute preemption.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
      max_tokens: tokens to generate at most (>= 1).
      temperature: 0 is greedy; > 0 scales the logits.
      top_k: keep the k most likely tokens; 0 keeps all.
      top_p: nucleus sampling mass in (0, 1]; 1 keeps all.
      seed: the request's seed; ``None`` lets the engine derive one from its own seed and the
        request's arrival order (deterministic for a given engine and request order).
      n: parallel samples of the same prompt; they share the prompt's KV blocks (fork + CoW).
      stop_token_ids: extra tokens that end generation (the stop token is kept in the output).
      ignore_eos: keep generating past EOS (benchmarks with fixed output lengths).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not isinstance(self.temperature, numbers.Real) or not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        if not isinstance(self.top_p, numbers.Real) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**31):
            raise ValueError(f"seed={self.seed!r} must be None or an integer in [0, 2**31)")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1")
        stops = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", stops)


def _sample_one(logits, temperature, top_k, top_p, seed, sample_index, position):
    """Samples one token from one row of logits (vmapped; every row independent of the others)."""
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(vocab)
    keep = rank < jnp.where(top_k > 0, top_k, vocab)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    mass_before = jnp.cumsum(probs) - probs
    keep &= (mass_before < top_p) | (rank == 0)
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
    """Greedy / temperature / top-k / top-p sampling, one independent key per row (traceable)."""
    return jax.vmap(_sample_one)(logits.astype(jnp.float32), temperature, top_k, top_p, seed,
                                 sample_index, position)
