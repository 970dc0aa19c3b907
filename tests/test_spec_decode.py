"""Speculative decoding (n-gram proposals): greedy output identical to plain decoding, the
rejection rule exact in distribution, staged KV rolled back and never cached, nothing leaked."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import prompts, small_model

from paged import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from paged.engine import sampler as sampling


def _engine(k: int | None, **kw) -> Engine:
    cfg, params = small_model()
    base = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
                attention_impl="xla", debug_checks=True)
    base.update(kw)
    # One token and one sequence bucket: few step shapes to compile (bucketing is tested apart).
    base.setdefault("min_token_bucket", base["max_num_batched_tokens"])
    base.setdefault("min_seq_bucket", base["max_num_seqs"])
    spec = None if k is None else SpeculativeConfig(num_speculative_tokens=k)
    return Engine(EngineConfig(**base, speculative=spec), model_config=cfg, params=params)


def _prompts() -> list[list[int]]:
    """Mixed prompts, some repetitive (n-gram proposals hit), some not."""
    rep = [p * 3 for p in prompts(3, seed=3, min_len=4, max_len=9)]
    return rep + prompts(3, seed=4, min_len=5, max_len=30)


_verify = jax.jit(sampling.verify)  # one compilation (eager vmap compiles every primitive)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _staged_is_zero(engine: Engine) -> None:
    for s in engine.scheduler.running:  # between steps: no slot holds a proposed token
        assert engine.block_manager.num_tokens(s.seq_id) <= s.num_tokens
    assert engine.kv_stats()["num_staged_tokens"] == 0


@pytest.mark.parametrize("k, block_size", [(1, 4), (3, 16), (6, 4)])
def test_greedy_output_is_identical(k, block_size):
    want = [o.token_ids for o in _engine(None, block_size=block_size).generate(_prompts(), GREEDY)]
    engine = _engine(k, block_size=block_size)
    got = [o.token_ids for o in engine.generate(_prompts(), GREEDY)]
    assert got == want
    stats = engine.spec_decode_stats()
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_identity_under_preemption_and_prefix_caching(mode):
    kw = dict(num_blocks=24, block_size=4, max_model_len=64, preemption_mode=mode,
              enable_prefix_caching=True)
    ps = _prompts() + _prompts()[:3]  # repeated prompts hit the prefix cache
    want = [o.token_ids for o in _engine(None, **kw).generate(ps, GREEDY)]
    engine = _engine(3, **kw)
    outs = []
    for i, p in enumerate(ps):
        engine.add_request(f"q{i}", p, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        _staged_is_zero(engine)
    outs = [done[f"q{i}"] for i in range(len(ps))]
    assert outs == want
    assert engine.kv_stats()["num_preemptions"] > 0
    assert engine.kv_stats()["prefix_cache_hit_tokens"] > 0
    assert engine.spec_decode_stats()["num_accepted_tokens"] > 0


def test_aborts_leak_nothing_and_a_rerun_repeats_itself():
    sp = SamplingParams(max_tokens=30, temperature=0.9, seed=1)
    runs = []
    for _ in range(2):
        engine = _engine(6, block_size=4)  # test_greedy_output_is_identical[6-4]'s step shapes
        free = engine.block_manager.num_free_blocks + engine.block_manager.num_cached_blocks
        for i, p in enumerate(_prompts()):
            engine.add_request(f"r{i}", p, sp)
        got, steps = {}, 0
        while engine.has_unfinished_requests():
            if steps == 4:
                assert engine.abort("r0") and engine.abort("r4")
            for o in engine.step():
                got[o.request_id] = o.token_ids
            _staged_is_zero(engine)
            steps += 1
        engine.block_manager.evict_cached()
        assert engine.block_manager.num_free_blocks == free  # every block back
        runs.append(got)
    assert runs[0] == runs[1]  # same config, seeds and requests: the same tokens


def test_budget_rule_cuts_drafts_to_the_step_budget():
    engine = _engine(6, max_num_batched_tokens=8, max_num_seqs=4)
    ps = [p * 4 for p in prompts(4, seed=8, min_len=2, max_len=4)]
    want = [o.token_ids for o in _engine(None, max_num_batched_tokens=8, max_num_seqs=4)
            .generate(ps, GREEDY)]
    steps = []
    for i, p in enumerate(ps):
        engine.add_request(f"b{i}", p, GREEDY)
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] = o.token_ids
        steps.append(engine.last_timing.num_tokens)
    assert max(steps) <= 8  # the budget holds with drafts
    assert [got[f"b{i}"] for i in range(4)] == want


def test_rejection_rule_is_exact_in_distribution():
    """Slot 0 of a verify row, many seeds: the emitted token's distribution must be the target's
    p, whatever the draft. Chi-square over 8 tokens (7 degrees of freedom) at a false-alarm rate
    of 0.1 % (critical value 24.32). Accepting the draft always would put all mass on it."""
    vocab = 8
    logits = jnp.asarray(np.log(np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])))
    n = 4000
    rows = jnp.tile(logits[None], (n, 1))
    ones = jnp.ones(n, jnp.float32)
    args = (rows, ones, jnp.zeros(n, jnp.int32), ones, jnp.arange(n, dtype=jnp.int32),
            jnp.zeros(n, jnp.int32), jnp.full(n, 5, jnp.int32))
    p = np.exp(np.asarray(logits))
    for draft in (0, 3, 7):
        tokens, accept = _verify(*args, jnp.full(n, draft, jnp.int32))
        counts = np.bincount(np.asarray(tokens), minlength=vocab)
        chi2 = float((((counts - n * p) ** 2) / (n * p)).sum())
        assert chi2 < 24.32, (draft, counts, chi2)
        # Acceptance happens with probability p(draft).
        assert abs(float(np.mean(np.asarray(accept))) - p[draft]) < 4 * np.sqrt(p[draft] / n) + 0.01
    always = np.bincount(np.full(n, 3), minlength=vocab)  # the wrong rule fails the same test
    assert float((((always - n * p) ** 2) / (n * p)).sum()) > 24.32


def test_greedy_verify_accepts_exactly_the_argmax():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0]] * 4)
    z = jnp.zeros(4, jnp.int32)
    tokens, accept = _verify(logits, jnp.zeros(4), z, jnp.ones(4), z, z, z,
                                     jnp.asarray([1, 2, -1, 3], jnp.int32))
    assert np.asarray(tokens).tolist() == [1, 1, 1, 1]
    assert np.asarray(accept).tolist() == [True, False, False, False]


@pytest.mark.parametrize("kw, err", [
    (dict(num_speculative_tokens=0), ValueError), (dict(method="medusa"), ValueError),
    (dict(ngram_min=3, ngram_max=2), ValueError), (dict(num_speculative_tokens=True), TypeError),
])
def test_bad_configs_are_rejected(kw, err):
    with pytest.raises(err):
        SpeculativeConfig(**kw)


def test_engine_config_takes_only_a_speculative_config():
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        EngineConfig(speculative={"num_speculative_tokens": 3})


BUNDLED = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
               attention_impl="xla", min_seq_bucket=4, min_token_bucket=64)  # few compilations
TEXT = ["def main():\n    print(", "import os\nimport sys\n", "The quick brown fox"]


def test_draft_model_greedy_output_is_identical_under_swap_preemption():
    """The bundled tiny target with tiny-draft (the default draft model) proposing from its own
    cache (same tables), in a pool of 10 blocks, so sequences are swapped out and back: greedy
    tokens equal plain decoding's in a roomy pool. One draft engine for both checks (a second one
    in a roomy pool compiled its own step shapes for the same assertions)."""
    ps = TEXT + TEXT[:1]
    want = [o.token_ids for o in Engine(EngineConfig(**BUNDLED, async_scheduling=False))
            .generate(ps, GREEDY)]
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=3)
    assert spec.model == "tiny-draft"
    engine = Engine(EngineConfig(**BUNDLED, num_blocks=10, preemption_mode="swap",
                                 debug_checks=True, speculative=spec))
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == want
    assert engine.kv_stats()["num_swap_outs"] > 0
    stats = engine.spec_decode_stats()
    assert stats["draft_acceptance_rate"] > 0.5  # the pair is trained on the same corpus
    assert engine.block_manager.num_used_blocks == 0 and engine.kv_stats()["num_staged_tokens"] == 0


def test_rejection_rule_with_a_draft_distribution():
    """Drafts drawn from q (not a point mass): the emitted token is still distributed as p
    (chi-square, 7 degrees of freedom, false-alarm rate 0.1 %)."""
    vocab, n = 8, 4000
    p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    q = np.array([0.05, 0.05, 0.1, 0.3, 0.2, 0.1, 0.1, 0.1])
    drafts = np.random.default_rng(0).choice(vocab, n, p=q).astype(np.int32)
    rows = jnp.tile(jnp.asarray(np.log(p))[None], (n, 1))
    ones = jnp.ones(n, jnp.float32)
    tokens, accept = _verify(
        rows, ones, jnp.zeros(n, jnp.int32), ones, jnp.arange(n, dtype=jnp.int32),
        jnp.zeros(n, jnp.int32), jnp.full(n, 5, jnp.int32), jnp.asarray(drafts),
        jnp.asarray(q[None], jnp.float32), jnp.zeros(n, jnp.int32))
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    chi2 = float((((counts - n * p) ** 2) / (n * p)).sum())
    assert chi2 < 24.32, (counts, chi2)
    want_accept = float(np.minimum(p, q).sum())  # P(accept) = sum_x min(p(x), q(x))
    assert abs(float(np.mean(np.asarray(accept))) - want_accept) < 0.03
    naive = np.bincount(drafts, minlength=vocab)  # always accepting: distributed as q, caught
    assert float((((naive - n * p) ** 2) / (n * p)).sum()) > 24.32


def test_a_draft_with_another_vocabulary_is_refused():
    fixture = str(Path(__file__).parent / "fixtures" / "hf" / "llama")
    spec = SpeculativeConfig(method="draft", model="tiny-draft", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(EngineConfig(model=fixture, max_model_len=64, max_num_seqs=2, speculative=spec))
