"""Perplexity and KL against full KV for a KV policy, on a real model (`experiments/kv_policies.py`).

How eviction enters a scored forward: each corpus chunk (`experiments.quality_tasks`, the quality
study's corpus) is a *prefix* of ``fidelity_prefix`` tokens, which plays the prompt (the policy
is called once when it ends, as in the leaderboard's retrieval arms), and a *continuation* of
``fidelity_continuation`` tokens, teacher-forced and scored: the next-token distribution at each
continuation position under the policy against the same under full KV. The distributions come
from the dense reference masked to exactly the positions the policy keeps, per layer, KV head and
query (`tests/kv_policy_reference.py`, which replays the policy's calls on the reference's own
keys with the policy's own ``scores``); `tests/test_kv_policies.py` checks that the compacted
engine's tokens and log-probabilities equal this reference for every method, so the figures are
the engine's without teacher-forcing the engine (it samples its own tokens). The masked pass is
jitted here (one compile per chunk length); the KL and top-1 agreement are the quality study's
(`experiments.quality.fidelity`). ``evidence: real`` (a real corpus, a real model).
"""

from __future__ import annotations

import numpy as np

from experiments import quality
from experiments import quality_tasks as tasks


def jit_pass(config, params):
    """The reference's masked pass, jitted: ``run(tokens, masks, probs) -> (logits, keys,
    probs)`` (numpy; ``probs`` the per-layer attention probabilities a mass-based policy's
    replay needs, else None). Stacked (scanned) parameters are unstacked: the masks are per
    layer."""
    import functools

    import jax
    import jax.numpy as jnp

    from paged.models.llama import Llama
    from paged.models.scan_layers import is_stacked, unstack_layers
    from tests.kv_policy_reference import MaskedAttention, patched

    params = unstack_layers(config, params) if is_stacked(params) else params
    model = Llama(config)

    @functools.partial(jax.jit, static_argnames=("probs",))
    def f(p, tokens, masks, probs):
        masked = MaskedAttention(masks, probs)
        with patched(masked):
            logits = model.apply(p, tokens[None], method="dense")
        return logits[0], jnp.stack(masked.keys), jnp.stack(masked.probs) if probs else None

    def run(tokens, masks, probs=False):
        logits, keys, pr = f(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(masks),
                             probs=bool(probs))
        return np.asarray(logits), np.asarray(keys), None if pr is None else np.asarray(pr)

    return run


def continuation_logprobs(config, params, run, chunk, policy, prefix: int) -> np.ndarray:
    """f64[T, V]: the distributions of the continuation's tokens (rows ``prefix - 1 ..``)."""
    from paged.config.kv_policy import KVPolicyConfig
    from paged.kv import policies
    from tests.kv_policy_reference import reference

    pol = policies.build(policy if policy is not None else KVPolicyConfig("full"))
    lp, _ = reference(config, params, chunk, pol, prefix, run=run)
    return lp[prefix - 1:len(chunk) - 1]


def chunks(c, corpus: list[int]) -> list[list[int]]:
    return tasks.chunks(corpus, c.fidelity_prefix + c.fidelity_continuation, c.fidelity_chunks)


def score(ref: list[np.ndarray], got: list[np.ndarray], chunk_list, prefix: int) -> dict:
    """KL(full || policy), top-1 agreement (``quality.fidelity``) and the continuation's
    perplexity under the policy."""
    nll = [-g[i, ids[prefix + i]] for g, ids in zip(got, chunk_list, strict=True)
           for i in range(len(g))]
    return {**quality.fidelity(ref, got), "perplexity": float(np.exp(np.mean(nll))),
            "nll_mean": float(np.mean(nll))}


__all__ = ["chunks", "continuation_logprobs", "jit_pass", "score"]
