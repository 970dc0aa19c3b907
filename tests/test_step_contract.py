"""What ``Engine.step()`` returns and when the drain loop may stop.

1. ``step()`` returns only requests that got new tokens or finished (vLLM's contract): a step
   that computed only part of a prompt (chunked prefill, a recompute after preemption, the
   uncached rest of a prefix hit) reports nothing for that request. Checked with overlap on and
   off, and with speculation.
2. ``has_unfinished_requests()`` stays true while a step is in flight or an abort / timeout is
   unreported, so ``while engine.has_unfinished_requests(): engine.step()`` leaves no step in
   flight, no quarantined block, every abort reported once and the pool as it started, after any
   sequence of adds, aborts and timeouts.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import prompts, small_model

from paged import Engine, EngineConfig, SamplingParams
from paged.engine.spec_decode import SpeculativeConfig


def _engine(**overrides) -> Engine:
    cfg, params = small_model()
    base = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                attention_impl="xla", min_token_bucket=64, min_seq_bucket=8)
    base.update(overrides)
    return Engine(EngineConfig(**base), model_config=cfg, params=params)


def _check_progress(engine: Engine, requests) -> dict[str, object]:
    """Runs ``requests`` to the end; asserts every output has new tokens or is final."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    seen: dict[str, int] = {}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            rid = out.request_id
            total = sum(len(o.token_ids) for o in out.outputs)
            assert rid not in final, f"{rid} reported after its final output"
            assert out.finished or total > seen.get(rid, 0), (
                f"{rid}: output without progress ({total} tokens, had {seen.get(rid, 0)})")
            seen[rid] = total
            if out.finished:
                final[rid] = out
    assert not engine.has_step_in_flight()
    assert set(final) == {r for r, _, _ in requests}
    return final


# Long prompts against a 16-token budget: several chunks each; a shared 24-token prefix (three
# full blocks) gives prefix hits; a 10-block pool forces preemption.
_SHARED = prompts(1, seed=11, min_len=24, max_len=25)[0][:24]


def _requests(n: int = 6, seed: int = 3, max_tokens: int = 12):
    ps = prompts(n, seed=seed, min_len=10, max_len=30)
    ps[1::2] = [_SHARED + p[1:8] for p in ps[1::2]]
    return [(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(ps)]


@pytest.mark.parametrize("overlap", [True, False])
def test_step_reports_only_requests_with_new_tokens(overlap):
    engine = _engine(max_num_batched_tokens=16, min_token_bucket=16, num_blocks=11,
                     async_scheduling=overlap)
    _check_progress(engine, _requests())
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0, stats      # the cases the contract covers happened
    assert stats["prefix_cache_hit_tokens"] > 0, stats


def test_step_reports_only_requests_with_new_tokens_speculative():
    # Repetitive prompts so the n-gram proposer finds drafts; verify rows keep >= 1 token.
    reqs = [(f"s{i}", [256] + [5, 6, 7, 8] * 6, SamplingParams(max_tokens=10, temperature=0.0,
                                                               ignore_eos=True)) for i in range(3)]
    engine = _engine(max_num_batched_tokens=16, min_token_bucket=16,
                     speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    _check_progress(engine, reqs)
    assert engine.spec_decode_stats()["num_drafts"] > 0


def test_issue_reproduction_chunked_prompt_reports_nothing_before_its_first_token():
    engine = _engine(max_num_batched_tokens=32, min_token_bucket=32, min_seq_bucket=4,
                     max_num_seqs=4)
    engine.add_request("r", prompts(1, seed=2, min_len=45, max_len=46)[0],
                       SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    counts = []
    while engine.has_unfinished_requests():
        counts += [(len(o.outputs[0].token_ids), o.finished) for o in engine.step()]
    assert counts == [(1, False), (2, False), (3, True)]


@pytest.mark.parametrize("overlap", [True, False])
def test_drain_after_aborting_everything_in_flight(overlap):
    engine = _engine(async_scheduling=overlap)
    free0 = engine.kv_stats()["num_free_blocks"]
    for rid, p, sp in _requests(8, seed=5, max_tokens=40):
        engine.add_request(rid, p, sp)
    engine.step()
    engine.step()
    for i in range(8):
        assert engine.abort(f"r{i}")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert not engine.has_step_in_flight()
    stats = engine.kv_stats()
    assert stats["num_quarantined_blocks"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == free0
    assert sorted(o.request_id for o in outs if o.finished) == [f"r{i}" for i in range(8)]
    assert all(o.finish_reason == "abort" for o in outs if o.finished)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drain_after_random_adds_aborts_and_timeouts(seed):
    rng = np.random.default_rng(seed)
    engine = _engine(num_blocks=13, async_scheduling=bool(seed % 2 == 0))
    free0 = engine.kv_stats()["num_free_blocks"]
    ps = prompts(12, seed=seed, min_len=3, max_len=30)
    added, aborted, reported = [], [], {}
    for i, p in enumerate(ps):
        timeout = 1e-4 if rng.random() < 0.25 else None  # expires at the next step
        sp = SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=0.0,
                            ignore_eos=True)
        engine.add_request(f"q{i}", p, sp, timeout_s=timeout)
        added.append(f"q{i}")
        for _ in range(int(rng.integers(0, 3))):
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in reported
                    reported[out.request_id] = out.finish_reason
        live = engine.unfinished_request_ids()
        if live and rng.random() < 0.4:
            victim = live[int(rng.integers(len(live)))]
            if engine.abort(victim):
                aborted.append(victim)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in reported, f"{out.request_id} reported twice"
                reported[out.request_id] = out.finish_reason
    assert not engine.has_step_in_flight()
    stats = engine.kv_stats()
    assert stats["num_quarantined_blocks"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == free0
    assert stats["num_used_blocks"] == 0
    assert sorted(reported) == sorted(added)
    assert all(reported[r] == "abort" for r in aborted)
