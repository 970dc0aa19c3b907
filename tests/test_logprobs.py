"""Log-probabilities (``SamplingParams.logprobs`` / ``prompt_logprobs``, vLLM's meaning): equal to
a dense float64 log-softmax of the model's logits, through chunked prefill, overlap, prefix
caching and parallel samples."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import _dense_fn, prompts, small_model

from paged import Engine, EngineConfig, SamplingParams


def _engine(overlap: bool = True, **kw) -> Engine:
    cfg, params = small_model()
    base = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64,
                attention_impl="xla", async_scheduling=overlap)
    base.update(kw)
    # One token and one sequence bucket: few step shapes to compile (bucketing is tested apart,
    # in tests/test_batch.py).
    base.setdefault("min_token_bucket", base["max_num_batched_tokens"])
    base.setdefault("min_seq_bucket", base["max_num_seqs"])
    return Engine(EngineConfig(**base), model_config=cfg, params=params)


def _dense_logprobs(tokens: list[int]) -> np.ndarray:
    """f64[len(tokens), V]: row i is the log-distribution of the token after position i."""
    cfg, params = small_model()
    padded = np.zeros((1, 64), np.int32)  # one width (causal: padding after changes nothing)
    padded[0, :len(tokens)] = tokens
    logits = np.asarray(_dense_fn(cfg)(params, jnp.asarray(padded)))[0, :len(tokens)]
    logits = logits.astype(np.float64)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("overlap", [True, False])
def test_logprobs_equal_a_dense_reference(overlap):
    ps = prompts(3, seed=1, min_len=10, max_len=30)  # longer than one step's 16 tokens: chunked
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)
    for p, out in zip(ps, _engine(overlap).generate(ps, sp)):
        ref = _dense_logprobs(p + out.token_ids)
        plp = out.prompt_logprobs
        assert len(plp) == len(p) and plp[0] is None
        for i in range(1, len(p)):
            assert list(plp[i])[0] == p[i] and len(plp[i]) <= 3  # the actual token first, top 2
            np.testing.assert_allclose(plp[i][p[i]], ref[i - 1, p[i]], atol=2e-5)
            top = np.argsort(-ref[i - 1])[:2]
            assert set(top.tolist()) <= set(plp[i]) or np.isclose(*ref[i - 1, top], atol=1e-5)
        glp = out.outputs[0].logprobs
        assert len(glp) == len(out.token_ids) == 6
        for j, t in enumerate(out.token_ids):
            assert list(glp[j])[0] == t
            np.testing.assert_allclose(glp[j][t], ref[len(p) - 1 + j, t], atol=2e-5)
            # Before temperature: the model's own distribution, not the sampled one.
            best = int(np.argmax(ref[len(p) - 1 + j]))
            np.testing.assert_allclose(glp[j][best], ref[len(p) - 1 + j, best], atol=2e-5)


def test_greedy_tokens_are_the_most_likely_and_unasked_is_none():
    p = prompts(1, seed=5)[0]
    engine = _engine()
    [out] = engine.generate([p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                logprobs=0))
    for d, t in zip(out.outputs[0].logprobs, out.token_ids):
        assert list(d) == [t]  # k = 0: the sampled token only
    [plain] = engine.generate([p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None
    assert plain.token_ids == out.token_ids
    [top] = _engine().generate([p], SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True, logprobs=5))
    for d, t in zip(top.outputs[0].logprobs, top.token_ids):
        assert d[t] == max(d.values())


def test_a_prefix_cache_hit_does_not_drop_prompt_logprobs():
    p = prompts(1, seed=7, min_len=30, max_len=40)[0]
    engine = _engine(enable_prefix_caching=True)
    engine.generate([p], SamplingParams(max_tokens=2, temperature=0.0))  # caches p's blocks
    sp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    [out] = engine.generate([p], sp)
    [fresh] = _engine(enable_prefix_caching=False).generate([p], sp)
    assert out.num_cached_tokens == 0  # such a request skips the cache
    assert all(d is not None for d in out.prompt_logprobs[1:])
    for a, b in zip(out.prompt_logprobs[1:], fresh.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and np.allclose(list(a.values()), list(b.values()), atol=1e-6)


def test_parallel_samples_each_score_their_own_tokens():
    p = prompts(1, seed=9)[0]
    [out] = _engine().generate([p], SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=3,
                                                   ignore_eos=True, logprobs=1))
    for sample in out.outputs:
        ref = _dense_logprobs(p + sample.token_ids)
        for j, t in enumerate(sample.token_ids):
            assert list(sample.logprobs[j])[0] == t
            np.testing.assert_allclose(sample.logprobs[j][t], ref[len(p) - 1 + j, t], atol=2e-5)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_logprob_counts_are_rejected(field, value):
    with pytest.raises((TypeError, ValueError), match=field):
        SamplingParams(**{field: value})
