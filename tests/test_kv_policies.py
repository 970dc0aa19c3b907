"""KV policies (docs/kv-policies.md): the compacted engine gives the tokens and log-probabilities
of a dense reference masked to exactly the positions the policy kept; ``full`` and a window at
least the sequence change nothing; freed pages are what the counters report; refusals."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import prompts, small_model
from kv_policy_reference import reference

from paged import Engine, EngineConfig, SamplingParams
from paged.config import kv_policy as kvp
from paged.config.kv_policy import KVPolicyConfig
from paged.kv import policies

BASE = dict(block_size=4, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32,
            min_token_bucket=32, min_seq_bucket=4, debug_checks=True)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)


def _engine(policy, **kw):
    cfg, params = small_model()
    return Engine(EngineConfig(**{**BASE, **kw}, kv_policy=policy), model_config=cfg,
                  params=params)


def _run(policy, ps, sp=GREEDY, **kw):
    engine = _engine(policy, **kw)
    return engine.generate(ps, sp), engine


def test_registry_names_agree_with_the_config():
    assert tuple(policies.POLICIES) == kvp.METHODS


def test_full_and_a_long_window_change_nothing():
    ps = prompts(3, seed=1, min_len=20, max_len=50)
    base, _ = _run(None, ps)
    for pol in (KVPolicyConfig("full", interval=2),
                KVPolicyConfig("streaming_llm", budget=128, interval=3)):
        outs, engine = _run(pol, ps)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        assert engine.kv_stats()["kv_policy"]["tokens_dropped"] == 0


CASES = [
    KVPolicyConfig("streaming_llm", budget=12, sink_tokens=2, interval=4),
    KVPolicyConfig("knorm", budget=0.5, interval=3),
    KVPolicyConfig("knorm", budget=9),
]


@pytest.mark.parametrize("pol", CASES, ids=lambda p: f"{p.method}-{p.budget}-{p.interval}")
@pytest.mark.parametrize("caching", [True, False])
def test_compacted_engine_equals_the_masked_dense_reference(pol, caching):
    """Tokens and log-probs equal the reference; with prefix caching off every freed page dies
    and is NaN-poisoned (debug_checks), so reading one would show."""
    cfg, params = small_model()
    ps = prompts(3, seed=2, min_len=18, max_len=40)
    outs, engine = _run(pol, ps, enable_prefix_caching=caching)
    policy = policies.build(pol)
    dropped = 0
    for p, out in zip(ps, outs):
        toks = out.outputs[0].token_ids
        lp, calls = reference(cfg, params, p + toks, policy, len(p))
        dropped += sum(1 for _ in calls)
        for j, t in enumerate(toks):
            row = lp[len(p) - 1 + j]
            best = int(np.argmax(row))
            assert t == best or np.isclose(row[t], row[best], atol=1e-4), (j, t, best)
            np.testing.assert_allclose(out.outputs[0].logprobs[j][t], row[t], atol=1e-4)
    stats = engine.kv_stats()
    assert dropped > 0 and stats["kv_policy"]["compactions"] >= len(ps)
    assert stats["ledger"]["evicted_bytes"] == \
        stats["kv_policy"]["pages_freed"] * stats["ledger"]["bytes_per_block"]
    assert engine.block_manager.compacted_blocks == stats["kv_policy"]["pages_freed"]


@pytest.mark.parametrize("kw, match", [
    (dict(method="knorm", budget=0), "budget"),
    (dict(method="knorm", budget=1.5), "budget"),
    (dict(method="knorm", budget=True), "budget"),
    (dict(method="h2o"), "method"),
    (dict(method="streaming_llm", budget=4, sink_tokens=4), "sink_tokens"),
    (dict(method="knorm", interval=-1), "interval"),
])
def test_bad_settings_are_one_clear_error(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KVPolicyConfig(**kw)


@pytest.mark.parametrize("kw", [dict(kv_layout="contiguous"), dict(kv_cache_dtype="int8"),
                                dict(cascade_attention="on")])
def test_unsupported_combinations_are_refused_at_construction(kw):
    with pytest.raises(ValueError, match="kv_policy"):
        EngineConfig(kv_policy=KVPolicyConfig("knorm", budget=0.5), **kw)
