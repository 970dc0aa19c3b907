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


def test_equal_policies_are_one_static_argument():
    """The jitted compaction takes the policy as a static argument: equal settings of one method
    compare (and hash) equal, so engines share its compilations; a token budget and a fraction
    of the same number, or another method, do not."""
    a, b = (policies.build(KVPolicyConfig("knorm", budget=0.5)) for _ in range(2))
    assert a is not b and a == b and hash(a) == hash(b)
    assert policies.build(KVPolicyConfig("knorm", budget=1)) != policies.build(
        KVPolicyConfig("knorm", budget=1.0))
    assert policies.build(KVPolicyConfig("snapkv", budget=12, window=4)) != policies.build(
        KVPolicyConfig("pyramidkv", budget=12, window=4))


def test_full_and_a_long_window_change_nothing():
    ps = prompts(3, seed=1, min_len=20, max_len=50)
    base, _ = _run(None, ps)
    for pol in (KVPolicyConfig("full", interval=2),
                KVPolicyConfig("streaming_llm", budget=128, interval=3),
                # A covering budget: the attention mass is computed (a second pass; SnapKV's
                # path is PyramidKV's without holes) and the tokens stay those of no policy.
                KVPolicyConfig("h2o", budget=128, recent_tokens=4, interval=3),
                KVPolicyConfig("pyramidkv", budget=128, window=4, beta=2.0)):
        outs, engine = _run(pol, ps)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        assert engine.kv_stats()["kv_policy"]["tokens_dropped"] == 0


CASES = [
    KVPolicyConfig("streaming_llm", budget=12, sink_tokens=2, interval=4),
    KVPolicyConfig("knorm", budget=0.5, interval=3),
    KVPolicyConfig("knorm", budget=9),
    # Attention mass (paged.kv.mass): accumulated over every query, compacted every 4 tokens.
    KVPolicyConfig("h2o", budget=12, recent_tokens=4, interval=4),
    KVPolicyConfig("h2o", budget=0.5, recent_tokens=2, interval=5),
    # The prompt's last 4 queries vote, pooled over 3 slots (avg; max).
    KVPolicyConfig("snapkv", budget=12, window=4, kernel=3),
    KVPolicyConfig("snapkv", budget=0.4, window=3, kernel=5, pooling="max"),
    # Per-layer budgets [18, 6] of 12 (2 layers, beta 2): the second layer hides 12 slots.
    KVPolicyConfig("pyramidkv", budget=12, window=2, kernel=3, beta=2.0),
]


# Prefix caching on and off for the key-based methods; off only for the mass-based ones (their
# compaction is the same code; off poisons every freed page, the stronger check).
RUNS = [(p, c) for p in CASES for c in ((False,) if policies.build(p).mass_window is not None
                                          else (True, False))]


@pytest.mark.parametrize("pol, caching", RUNS,
                         ids=lambda x: f"{x.method}-{x.budget}-{x.interval}"
                         if isinstance(x, KVPolicyConfig) else str(x))
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
    (dict(method="tova"), "method"),
    (dict(method="streaming_llm", budget=4, sink_tokens=4), "sink_tokens"),
    (dict(method="knorm", interval=-1), "interval"),
    (dict(method="h2o", budget=8, recent_tokens=8), "recent_tokens"),
    (dict(method="h2o", recent_tokens=-1), "recent_tokens"),
    (dict(method="h2o", recent_tokens=1.0), "recent_tokens"),
    (dict(method="snapkv", budget=16, window=16), "window"),
    (dict(method="snapkv", window=0), "window"),
    (dict(method="snapkv", kernel=4), "kernel"),
    (dict(method="snapkv", kernel=0), "kernel"),
    (dict(method="snapkv", pooling="median"), "pooling"),
    (dict(method="snapkv", budget=0.5, interval=8), "interval"),
    (dict(method="pyramidkv", budget=0.5, interval=8), "interval"),
    (dict(method="pyramidkv", beta=0.5), "beta"),
    (dict(method="pyramidkv", budget=64, window=64), "window"),
])
def test_bad_settings_are_one_clear_error(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KVPolicyConfig(**kw)


@pytest.mark.parametrize("kw", [dict(kv_layout="contiguous"), dict(kv_cache_dtype="int8"),
                                dict(cascade_attention="on")])
def test_unsupported_combinations_are_refused_at_construction(kw):
    with pytest.raises(ValueError, match="kv_policy"):
        EngineConfig(kv_policy=KVPolicyConfig("knorm", budget=0.5), **kw)


SMALL_POOL = dict(max_model_len=64, num_blocks=19, max_num_batched_tokens=32)
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
POL = KVPolicyConfig("knorm", budget=0.75, interval=5)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


MASS_POL = KVPolicyConfig("h2o", budget=0.75, recent_tokens=4, interval=5)


@pytest.mark.parametrize("mode, pol", [("recompute", POL), ("swap", POL), ("swap", MASS_POL)],
                         ids=["recompute", "swap", "swap-h2o"])
def test_preemption_replays_the_policy_exactly(mode, pol):
    """A pool too small for every sequence: preempted sequences (recomputed, chunks stopping
    at the policy's points; or swapped out and in, H2O's attention mass with their pages) end
    with the tokens of a pool that fits."""
    ps = prompts(4, seed=3, min_len=20, max_len=30)
    roomy, _ = _run(pol, ps, LONG, max_model_len=64)
    tight, engine = _run(pol, ps, LONG, preemption_mode=mode, num_host_blocks=64, **SMALL_POOL)
    assert engine.kv_stats()["num_preemptions"] > 0
    assert _tokens(tight) == _tokens(roomy)


def test_forked_samples_keep_shared_blocks_whole():
    """Greedy samples of one prompt (n=2) share the compacted prompt; each later call leaves the
    shared blocks whole, symmetrically: both samples give the same tokens, and invariants hold
    after every step (debug_checks)."""
    ps = prompts(2, seed=4, min_len=20, max_len=30)
    sp = SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True)
    outs, engine = _run(POL, ps, sp)
    for o in outs:
        assert o.outputs[0].token_ids == o.outputs[1].token_ids
    assert engine.kv_stats()["kv_policy"]["compactions"] > 2


def test_a_compacted_sequence_serves_no_wrong_prefix_hit():
    """B's prompt is A's prompt and output: after A was compacted, B's prefix hits (freed blocks
    still keyed hold their content) give B exactly the tokens of a cold engine."""
    [a] = prompts(1, seed=5, min_len=30, max_len=31)
    warm = _engine(POL)
    [out_a] = warm.generate([a], LONG)
    b = a + out_a.outputs[0].token_ids[:8]
    [warm_b] = warm.generate([b], GREEDY)
    [cold_b] = _engine(POL).generate([b], GREEDY)
    assert warm_b.outputs[0].token_ids == cold_b.outputs[0].token_ids


@pytest.mark.parametrize("pol", [POL, KVPolicyConfig("streaming_llm", budget=24, interval=6)],
                         ids=lambda p: p.method)
def test_random_traffic_with_hits_forks_preemption_and_aborts(pol):
    """Shared prefixes (hits), n > 1 (forks), a small pool (preemption), aborts, overlap: the
    block manager's and the input batch's invariants hold after every step (debug_checks),
    freed pages are NaN-poisoned and never read (log-probs stay finite), every request ends."""
    rng = np.random.default_rng(6)
    engine = _engine(pol, **{**SMALL_POOL, "num_blocks": 17, "max_num_batched_tokens": 16,
                             "min_token_bucket": 16})
    # Shared prefixes longer than a step's tokens: their first chunk is keyed (and hit) before
    # the prompt's end compacts it (a prompt compacted in its first step is never keyed).
    shared = prompts(2, seed=7, min_len=18, max_len=19)
    pending, added = {}, 0
    for _ in range(120):
        if added < 14 and rng.random() < 0.6:
            p = list(shared[added % 2]) + rng.integers(0, 256, rng.integers(2, 12)).tolist()
            sp = SamplingParams(n=int(rng.integers(1, 3)), max_tokens=int(rng.integers(4, 20)),
                                temperature=float(rng.choice([0.0, 0.8])), seed=added,
                                ignore_eos=True, logprobs=0)
            engine.add_request(f"r{added}", p, sp)
            pending[f"r{added}"] = sp
            added += 1
        if pending and rng.random() < 0.05:
            engine.abort(str(rng.choice(sorted(pending))))
        for out in engine.step():
            if out.finished:
                sp = pending.pop(out.request_id)
                for c in out.outputs:
                    if c.finish_reason == "length":
                        assert len(c.token_ids) == sp.max_tokens
                        assert all(np.isfinite(next(iter(d.values()))) for d in c.logprobs)
        if added == 14 and not engine.has_unfinished_requests():
            break
    while engine.has_unfinished_requests():
        for out in engine.step():
            pending.pop(out.request_id, None) if out.finished else None
    assert not pending
    stats = engine.kv_stats()
    assert stats["kv_policy"]["compactions"] > 0 and stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["num_used_blocks"] == 0


def test_the_ledger_holds_exactly_the_surviving_slots():
    """After every step, the pool's used blocks are the kept slots' blocks (the saving is real,
    not a formula), and the ledger's held bytes are those blocks."""
    [p] = prompts(1, seed=8, min_len=30, max_len=31)
    engine = _engine(KVPolicyConfig("knorm", budget=8, interval=4), enable_prefix_caching=False,
                     async_scheduling=False)
    engine.add_request("a", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        if engine.batch.num_rows:
            [seq] = engine.batch.seqs
            slots = seq.num_computed_tokens - seq.num_dropped
            stats = engine.kv_stats()
            cats = stats["ledger"]["categories"]
            assert stats["num_used_blocks"] == -(-slots // 4)
            held = cats["effective_kv"] + cats["tail_fragmentation"] + cats["shared"]
            assert held == stats["num_used_blocks"] * stats["ledger"]["bytes_per_block"]
            seen += seq.num_dropped > 0
    assert seen and engine.kv_stats()["kv_policy"]["tokens_dropped"] > 0


def test_scores_in_numpy_pick_what_each_method_names():
    """The policy files run on numpy too: StreamingLLM ranks the sinks, then the most recent;
    KNorm the smallest keys."""
    keys = np.random.default_rng(0).normal(size=(1, 1, 10, 4)).astype(np.float32)
    pos = np.arange(10)[None, None]
    valid = np.ones(10, bool)
    s = policies.build(KVPolicyConfig("streaming_llm", budget=5, sink_tokens=2)).scores(
        np, keys, pos, valid)
    assert sorted(np.argsort(-s[0, 0], kind="stable")[:5].tolist()) == [0, 1, 7, 8, 9]
    k = policies.build(KVPolicyConfig("knorm", budget=3)).scores(np, keys, pos, valid)
    norms = np.linalg.norm(keys[0, 0], axis=-1)
    assert set(np.argsort(-k[0, 0])[:3].tolist()) == set(np.argsort(norms)[:3].tolist())
