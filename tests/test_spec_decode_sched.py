"""Speculative decoding composed with the scheduler's other paths: parallel sampling (n > 1:
forked samples each get their own verify rows) and request timeouts (a request that expires
under speculation frees its blocks and leaves nothing staged)."""

from __future__ import annotations

import dataclasses
import time
import types

import pytest
from engine_utils import prompts, small_model

import paged.engine.engine
from paged import Engine, EngineConfig, SamplingParams, SpeculativeConfig


def _engine(k: int | None, **kw) -> Engine:
    cfg, params = small_model()
    base = {"block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 96,
            "attention_impl": "xla", "debug_checks": True,
            "min_seq_bucket": 8, "min_token_bucket": 64}  # one token and one sequence bucket
    base.update(kw)
    spec = None if k is None else SpeculativeConfig(num_speculative_tokens=k)
    return Engine(EngineConfig(**base, speculative=spec), model_config=cfg, params=params)


def _prompts() -> list[list[int]]:
    """Repetitive prompts (n-gram proposals hit) and one that is not."""
    return [p * 3 for p in prompts(2, seed=3, min_len=4, max_len=9)] + prompts(1, seed=4, min_len=12)


def _free(engine: Engine) -> int:
    bm = engine.block_manager
    return bm.num_free_blocks + bm.num_cached_blocks


def _serve(engine: Engine, ps, params, **add) -> dict:
    """Runs ``ps`` to completion step by step; checks that nothing is staged between steps;
    returns each request's samples' token ids."""
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params, **add)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = [c.token_ids for c in o.outputs]
        assert engine.kv_stats()["num_staged_tokens"] == 0
        for s in engine.scheduler.running:  # no slot past the sequence's known tokens
            assert engine.block_manager.num_tokens(s.seq_id) <= s.num_tokens
    return done


def test_parallel_sampling_greedy_is_the_plain_output():
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2)
    want = _serve(_engine(None), _prompts(), sp)
    engine = _engine(3)
    free = _free(engine)
    got = _serve(engine, _prompts(), sp)
    assert got == want
    assert all(len(samples) == 2 and samples[0] == samples[1] for samples in got.values())
    assert engine.spec_decode_stats()["num_accepted_tokens"] > 0
    engine.block_manager.evict_cached()
    assert engine.block_manager.num_used_blocks == 0 and _free(engine) == free


def test_parallel_sampling_with_seeds_repeats_itself_and_leaks_nothing():
    sp = SamplingParams(max_tokens=20, temperature=0.8, seed=7, n=2)  # shapes of the test above
    runs = []
    for _ in range(2):
        engine = _engine(3)
        free = _free(engine)
        runs.append(_serve(engine, _prompts(), sp))
        assert engine.spec_decode_stats()["num_drafts"] > 0
        engine.block_manager.evict_cached()
        assert engine.block_manager.num_used_blocks == 0 and _free(engine) == free
    assert runs[0] == runs[1]
    assert all(len(samples) == 2 for samples in runs[0].values())
    assert any(len({tuple(s) for s in samples}) > 1 for samples in runs[0].values())


@pytest.mark.parametrize("n", [1, 2])
def test_timeout_under_speculation_frees_its_blocks(monkeypatch, n):
    """The engine's clock jumps past one request's deadline after a few verify steps: it ends
    with "timeout" at the next step with a prefix of its plain output, its blocks go back to the
    pool, nothing stays staged, and the other request is unaffected."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=n)
    ps = _prompts()[:2]
    want = _serve(_engine(None), ps, greedy)
    offset = [0.0]
    monkeypatch.setattr(paged.engine.engine, "time", types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + offset[0]))
    engine = _engine(3)
    free = _free(engine)
    engine.add_request("t", ps[0], greedy, timeout_s=1000.0)
    engine.add_request("u", ps[1], greedy)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 4:
            assert engine.spec_decode_stats()["num_drafts"] > 0  # it timed out under speculation
            used = engine.block_manager.num_used_blocks
            offset[0] = 2000.0
        outs = engine.step()
        for o in outs:
            if o.finished:
                done[o.request_id] = o
        assert engine.kv_stats()["num_staged_tokens"] == 0
        if steps == 4:
            assert "t" in done and done["t"].finish_reason == "timeout"
            assert engine.block_manager.num_used_blocks < used  # its blocks went back
        steps += 1
    t, u = done["t"], done["u"]
    for sample, plain in zip(t.outputs, want["r0"], strict=True):
        assert 0 < len(sample.token_ids) < len(plain) and plain[:len(sample.token_ids)] == \
            sample.token_ids
    assert [c.token_ids for c in u.outputs] == want["r1"] and u.finish_reason == "length"
    engine.block_manager.evict_cached()
    assert engine.block_manager.num_used_blocks == 0 and _free(engine) == free


def test_warmup_compiles_the_verify_shapes():
    """After ``warmup()`` an n-gram speculating engine serves without compiling anything."""
    cfg, params = small_model()
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    engine = Engine(EngineConfig(block_size=8, max_num_seqs=2, max_num_batched_tokens=8,
                                 max_model_len=64, attention_impl="xla", min_token_bucket=8,
                                 min_seq_bucket=2, speculative=spec),
                    model_config=cfg, params=params)
    assert engine.warmup() > 1
    before = engine.num_compilations
    rep = [256] + [5, 6, 7, 8] * 4  # repeats: the n-gram proposer has drafts to verify
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.generate([rep, rep[:9]], [plain, dataclasses.replace(plain, logprobs=2)])
    assert engine.spec_decode_stats()["num_drafts"] > 0
    assert engine.num_compilations == before
