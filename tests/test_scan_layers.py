"""Stacked layer params (`paged.models.scan_layers`): the scanned model equals the unrolled
one on tiny's trained weights (dense logits, paged greedy tokens, prompt log-probabilities)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged import Engine, EngineConfig, SamplingParams
from paged.models.llama import Llama
from paged.models.registry import load_model
from paged.models.scan_layers import can_stack, is_stacked, stack_layers, unstack_layers


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def test_stack_round_trip(tiny):
    config, params = tiny
    stacked = stack_layers(config, params)
    assert is_stacked(stacked) and not is_stacked(params)
    assert stacked["params"]["layers"]["attn"]["q_proj"].shape[0] == config.num_layers
    back = unstack_layers(config, stacked)
    assert jax.tree.all(jax.tree.map(np.array_equal, back, params))


def test_layers_of_different_kinds_cannot_stack():
    config, params = load_model("tiny-mixed")
    assert not can_stack(config) and can_stack(load_model("tiny-sliding")[0])
    with pytest.raises(ValueError, match="different kinds"):
        stack_layers(config, params)


def test_scanned_dense_equals_unrolled(tiny):
    config, params = tiny
    tokens = jnp.asarray([[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]])
    a = Llama(config).apply(params, tokens, method="dense")
    b = Llama(config).apply(stack_layers(config, params), tokens, method="dense")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-5)


def test_scanned_engine_equals_unrolled(tiny):
    config, params = tiny
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    prompts = ["hello world", "def f(x):\n    return", "The quick brown fox"]
    outs = [Engine(EngineConfig(model="tiny", max_num_batched_tokens=32, min_token_bucket=32),
                   model_config=config, params=p).generate(prompts, sp)
            for p in (params, stack_layers(config, params))]
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert la.keys() == lb.keys()
            assert all(abs(la[k] - lb[k]) < 1e-4 for k in la)
