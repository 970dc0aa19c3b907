"""A dense reference for KV policies: the full sequence recomputed with attention masked to
exactly the positions a policy kept, per layer, KV head and query (tests/test_kv_policies.py).

A query at position ``t`` sees the survivors of the last policy call at a point ``c <= t``
(per layer and KV head) and every position in ``[c, t]``; before the first call it sees all of
``[0, t]``. The calls are replayed on the reference's own keys (after RoPE, captured from the
dense pass), with the same policy ``scores`` in numpy: a call at ``c`` depends only on queries
before ``c``, so pass ``j`` of the dense model fixes call ``j``.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from paged.models import attention
from paged.models.llama import Llama


class MaskedAttention:
    """Replaces ``causal_attention`` during one dense pass (eager, or traced by ``jax.jit`` with
    ``masks`` an argument: ``experiments/kv_policies_fidelity.py``): per-layer masks, key
    capture (``keys``: one f32[S, Hkv, D] per layer) and, with ``probs``, the attention
    probabilities summed over each KV head's query heads (``probs``: one f32[Hkv, T, S] per
    layer)."""

    def __init__(self, masks, probs: bool = True):
        self.masks, self.layer, self.keys, self.probs = masks, 0, [], []
        self.want_probs = probs

    def __call__(self, q, k, v, *, sm_scale, soft_cap=None, sliding_window=None, mask=None):
        if mask is not None:  # the model's own selection mask (sparse decode): not combined
            raise ValueError("the masked KV-policy reference takes no other mask")
        mask = self.masks[self.layer]  # bool[Hkv, T, S]
        self.layer += 1
        self.keys.append(k[0].astype(jnp.float32))  # [S, Hkv, D]
        b, t, n, h = q.shape
        kh = k.shape[2]
        qg = q.astype(jnp.float32).reshape(b, t, kh, n // kh, h)
        logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32)) * sm_scale
        logits = jnp.where(jnp.asarray(mask)[None, :, None], logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1)
        if self.want_probs:
            self.probs.append(probs[0].astype(jnp.float32).sum(axis=1))  # [Hkv, T, S]
        out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(jnp.float32))
        return out.reshape(b, t, n, h).astype(q.dtype)


@contextlib.contextmanager
def patched(fn):
    old = attention.causal_attention
    attention.causal_attention = fn
    try:
        yield
    finally:
        attention.causal_attention = old


def _masks(num_layers, num_kv_heads, n, calls):
    """bool[L][Hkv, n, n]: query t sees key s (see the module docstring)."""
    causal = np.tril(np.ones((n, n), bool))
    out = np.broadcast_to(causal, (num_layers, num_kv_heads, n, n)).copy()
    for c, kept in calls:  # kept: bool[L, Hkv, c]; later calls override for t >= c
        out[:, :, c:, :c] = kept[:, :, None, :]
    return out


def _mass(policy, probs, c, prompt_len):
    """f32[L, Hkv, S] each key's attention mass from the queries before ``c`` that the policy's
    ``mass_window`` counts (every one, or the prompt's last w), under the masks in force
    (``probs``: per layer [Hkv, T, S], summed over the group's query heads); None: no mass."""
    if policy.mass_window is None:
        return None
    t = np.arange(probs[0].shape[1])
    w = t < c
    if policy.mass_window:
        w &= (t >= prompt_len - policy.mass_window) & (t < prompt_len)
    return np.stack([np.einsum("ht,hts->hs", np.broadcast_to(w, p.shape[:2]).astype(np.float32),
                               p) for p in probs])


def eager_pass(config, params):
    """``run(tokens, masks, probs) -> (logits [n, V], keys [L, n, Hkv, D], probs)``: one eager
    masked pass (``probs``: the per-layer probabilities of ``MaskedAttention``, else None)."""
    model = Llama(config)

    def run(tokens, masks, probs=False):
        masked = MaskedAttention(masks, probs)
        with patched(masked):
            logits = model.apply(params, jnp.asarray([tokens]), method="dense")
        return (logits[0], np.stack([np.asarray(k) for k in masked.keys]),
                [np.asarray(p) for p in masked.probs] if probs else None)

    return run


def reference(config, params, tokens, policy, prompt_len, run=None):
    """``(log-probs f64[n, V], calls)``: row i is the distribution of the token after position
    i under ``policy`` (a ``KVPolicy``), with the calls it made (``(point, kept)``). A policy
    with a ``mass_window`` gets each key's attention mass from the dense pass's probabilities
    (`_mass`); per-layer budgets (``layer_keep``) apply. ``run``: the masked pass (default
    ``eager_pass``; a study passes a jitted one)."""
    run = run or eager_pass(config, params)
    n = len(tokens)
    L, H = config.num_layers, config.num_kv_heads
    interval = policy.config.interval
    points = [prompt_len] + (list(range(prompt_len + interval, n, interval)) if interval else [])
    points = [c for c in points if c < n]
    calls, kept_prev, c_prev = [], None, 0
    for c in [*points, None]:
        logits, keys, probs = run(tokens, _masks(L, H, n, calls),
                                  probs=c is not None and policy.mass_window is not None)
        if c is None:
            break
        # The engine's slots at c: the last survivors, then every position since (in order).
        cand = np.zeros((L, H, c), bool)
        cand[:, :, c_prev:] = True
        if kept_prev is not None:
            cand[:, :, :c_prev] = kept_prev
        slots = int(cand[0, 0].sum())
        keeps = [max(k, 1) for k in policy.layer_keep(c, L)]
        if max(keeps) >= slots:
            continue
        mass = _mass(policy, probs, c, prompt_len)  # keys: [L, S, Hkv, D]
        kept = np.zeros((L, H, c), bool)
        for layer in range(L):
            for h in range(H):
                pos = np.flatnonzero(cand[layer, h])
                k = keys[layer, pos, h][None, None]
                m = None if mass is None else mass[layer, h, pos][None, None]
                score = policy.scores(np, k, pos[None, None], np.ones(len(pos), bool), mass=m)[0, 0]
                order = np.argsort(-np.asarray(score, np.float32), kind="stable")[:keeps[layer]]
                kept[layer, h, pos[order]] = True
        calls.append((c, kept))
        kept_prev, c_prev = kept, c
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True)), calls
