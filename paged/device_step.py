"""The engine's one jitted device call: model forward (KV written into the donated cache) + sampling."""

from __future__ import annotations

import functools

import jax

from paged import sampling
from paged.kv_cache import KVCache
from paged.models.config import LlamaConfig
from paged.models.llama import Llama


@functools.lru_cache(maxsize=32)
def make_step_fn(model_config: LlamaConfig, attention_impl: str):
    """Returns ``(step, trace_count)``, shared by every engine with the same model and attention.

    ``step(params, cache, batch) -> (cache, tokens i32[N])`` is jitted with the cache DONATED:
    XLA writes the new K/V in place and the caller must drop its old reference. ``trace_count()``
    says how many shapes were traced so far (one XLA compilation each); engines sharing the
    function share its compilations, so an engine reports the difference since its creation.
    """
    model = Llama(model_config)
    traces = [0]

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache: KVCache, batch):
        traces[0] += 1  # runs at trace time only
        logits, k_pages, v_pages = model.apply(
            params, batch.tokens, batch.positions, cache.k_pages, cache.v_pages, batch.md,
            batch.sample_rows, attention_impl=attention_impl)
        tokens = sampling.sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.seed,
                                 batch.sample_index, batch.sample_pos)
        return cache.replace(k_pages=k_pages, v_pages=v_pages), tokens

    return step, lambda: traces[0]
