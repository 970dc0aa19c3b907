"""Engine: paging, sharing, preemption and scheduling never change greedy outputs."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import greedy_reference, prompts, small_model

from paged import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(**overrides) -> Engine:
    cfg, params = small_model()
    base = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                attention_impl="xla", debug_checks=True)
    base.update(overrides)
    # One token and one sequence bucket: few step shapes to compile (bucketing is tested apart,
    # in tests/test_batch.py).
    base.setdefault("min_token_bucket", base["max_num_batched_tokens"])
    base.setdefault("min_seq_bucket", base["max_num_seqs"])
    return Engine(EngineConfig(**base), model_config=cfg, params=params)


def _tokens(engine: Engine, batch, params=GREEDY) -> list[list[int]]:
    outs = engine.generate(batch, params)
    assert all(o.finished for o in outs)
    return [o.token_ids for o in outs]


def _assert_no_leak(engine: Engine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} blocks still in use"
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def batch():
    return prompts(6, seed=1)


@pytest.fixture(scope="module")
def baseline(batch):
    return _tokens(_engine(enable_prefix_caching=False), batch)


def test_matches_no_cache_reference(batch, baseline):
    cfg, params = small_model()
    for prompt, got in list(zip(batch, baseline))[:3]:
        assert got == greedy_reference(cfg, params, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(kv_layout="contiguous"),
        dict(enable_prefix_caching=True),
        dict(block_size=16),
        dict(block_size=32),
        dict(scheduling="static"),
        dict(policy="prefill-first"),
        dict(policy="lpm"),
        dict(policy="dfs-weight", num_blocks=12),
        dict(max_num_batched_tokens=16),  # long prompts in several chunks
        dict(num_blocks=12, preemption_mode="recompute"),
        dict(num_blocks=12, preemption_mode="swap"),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_greedy_outputs_invariant(batch, baseline, overrides):
    engine = _engine(**overrides)
    assert _tokens(engine, batch) == baseline
    _assert_no_leak(engine)
    if "num_blocks" in overrides:
        assert engine.kv_stats()["num_preemptions"] > 0, "the tiny pool must force preemption"


def test_steady_decodes_take_the_batched_path(batch, baseline):
    """The invariance tests above cover both paths: prefill-first serves decodes one by one,
    decode-first batches them once every running sequence decodes."""
    engine = _engine(enable_prefix_caching=False)
    assert _tokens(engine, batch) == baseline
    assert engine.scheduler.num_fast_decode_steps >= GREEDY.max_tokens - 2
    slow = _engine(policy="prefill-first")
    assert _tokens(slow, batch) == baseline and slow.scheduler.num_fast_decode_steps == 0


def test_prefix_cache_hits_shared_system_prompt():
    system = prompts(1, seed=7, min_len=30, max_len=31)[0]
    batch = [system + p[1:] for p in prompts(4, seed=8, max_len=10)]
    off = _tokens(_engine(enable_prefix_caching=False), batch)
    engine = _engine(enable_prefix_caching=True, max_num_seqs=1)  # one at a time: later ones hit
    assert _tokens(engine, batch) == off
    stats = engine.kv_stats()
    assert stats["prefix_cache_hit_tokens"] >= 3 * (len(system) // 8) * 8
    _assert_no_leak(engine)


def test_parallel_sampling_shares_prompt_and_matches_separate_requests():
    prompt = prompts(1, seed=3, min_len=20, max_len=21)[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    engine = _engine()
    [out] = engine.generate([prompt], params)
    assert len(out.outputs) == 3 and out.finished
    samples = [o.token_ids for o in out.outputs]
    assert len({tuple(s) for s in samples}) > 1, "samples with different indices must differ"
    assert engine.kv_stats()["block_manager"]["cow_copies"] > 0
    _assert_no_leak(engine)
    # Sample 0 equals the same request with n=1 (its key depends only on seed, index, position).
    [single] = _engine().generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=11,
                                                           ignore_eos=True))
    assert single.token_ids == samples[0]


def test_seeded_sampling_independent_of_batch():
    batch = prompts(5, seed=4)
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_k=50, top_p=0.9, seed=i,
                             ignore_eos=True) for i in range(5)]
    together = [o.token_ids for o in _engine().generate(batch, params)]
    alone = [_engine().generate([p], [sp])[0].token_ids for p, sp in zip(batch[:2], params[:2])]
    assert together[:2] == alone


@pytest.mark.parametrize("phase_steps", [0, 3])  # abort during prefill / during decode
def test_abort_releases_everything(phase_steps):
    engine = _engine(max_num_batched_tokens=8)
    long_prompt = prompts(1, seed=5, min_len=39, max_len=40)[0]
    engine.add_request("a", long_prompt, GREEDY)
    engine.add_request("b", prompts(1, seed=6)[0], GREEDY)
    engine.step()
    for _ in range(phase_steps):
        engine.step()
    assert engine.abort("a")
    assert not engine.abort("a")  # already finished: says so, does nothing
    assert not engine.abort("nope")
    while engine.has_unfinished_requests():
        engine.step()
    _assert_no_leak(engine)


def test_timeout_releases_blocks():
    engine = _engine()
    engine.add_request("t", prompts(1)[0], GREEDY, timeout_s=1e-9)
    outs = engine.step()
    assert outs and outs[0].finished and outs[0].finish_reason == "timeout"
    _assert_no_leak(engine)


def test_stop_conditions():
    engine = _engine()
    p = prompts(1, seed=9)[0]
    [free_run] = engine.generate([p], GREEDY)
    stop_at = free_run.token_ids[3]
    [stopped] = engine.generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=(stop_at,)))
    first = free_run.token_ids.index(stop_at)
    assert stopped.token_ids == free_run.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and free_run.finish_reason == "length"
    # max_model_len ends generation too.
    [capped] = _engine(max_model_len=len(p) + 2).generate([p], GREEDY)
    assert len(capped.token_ids) == 2 and capped.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", GREEDY, "empty"),
        ([], GREEDY, "empty"),
        ([1] * 65, GREEDY, "max_model_len"),
        ([1, 300], GREEDY, "outside"),
        ("hi", "greedy", "SamplingParams"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(prompt, params, match):
    engine = _engine()
    engine.add_request("ok", prompts(1)[0], GREEDY)
    with pytest.raises((ValueError, TypeError), match=match):
        engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("ok", "again", GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    _assert_no_leak(engine)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_pool_too_small_for_one_request():
    with pytest.raises(ValueError, match="max_model_len"):
        _engine(num_blocks=4)  # 3 usable blocks of 8 < 64


def test_compiles_a_handful_of_shapes():
    engine = _engine(max_num_seqs=8, max_num_batched_tokens=32)
    batch = prompts(12, seed=12)
    engine.generate(batch, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert engine.num_steps > 20
    assert engine.num_compilations <= 12, engine.num_compilations


def test_kv_stats_ledger_sums_to_pool():
    engine = _engine()
    for i, p in enumerate(prompts(3, seed=13)):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(4):
        engine.step()
        stats = engine.kv_stats()
        ledger = stats["ledger"]
        assert ledger["pool_bytes"] == engine.cache.nbytes
        cats = ledger["categories"] if "categories" in ledger else ledger
        assert sum(cats[k] for k in ("effective_kv", "shared", "tail_fragmentation", "cached_free",
                                     "free", "null_page", "reserved")) == ledger["pool_bytes"]
    assert np.isfinite(np.asarray(engine.cache.k_pages[:, :, 1:2])).any()


@pytest.mark.parametrize("impl", ["interpret_tpu", "interpret_gpu"])
def test_pallas_interpret_matches_xla(impl):
    """A short run through the Pallas kernels (interpret mode) gives the XLA path's tokens."""
    from engine_utils import pallas_model

    cfg, params = pallas_model()
    batch = prompts(2, seed=14, max_len=12)
    params_ = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    runs = {}
    for attention_impl in ("xla", impl):
        engine = Engine(EngineConfig(block_size=8, max_num_seqs=2, max_num_batched_tokens=32,
                                     max_model_len=32, attention_impl=attention_impl,
                                     debug_checks=True), model_config=cfg, params=params)
        runs[attention_impl] = _tokens(engine, batch, params_)
    assert runs[impl] == runs["xla"]


def test_readback_without_decode_outputs_keeps_every_finished_output(batch):
    """``StepReader.make_outputs = False`` (the simulator's setting): decodes of unfinished
    requests get no output, and each finished request's output is the one a normal engine makes
    (parallel samples and forks included)."""
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.8, seed=i, n=1 + i % 2)
              for i in range(len(batch))]

    def run(make_outputs: bool):
        engine = _engine(async_scheduling=False)
        engine.core.reader.make_outputs = make_outputs
        for i, (p, sp) in enumerate(zip(batch, params)):
            engine.add_request(f"r{i}", p, sp)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        _assert_no_leak(engine)
        return outs

    def finished(outs):
        return {o.request_id: [(s.index, s.token_ids, s.finish_reason) for s in o.outputs]
                for o in outs if o.finished}

    full, lean = run(True), run(False)
    assert finished(lean) == finished(full) and len(finished(full)) == len(batch)
    assert sum(not o.finished for o in lean) < sum(not o.finished for o in full)
