"""Steady decode runs (``paged.decode_run``): keeping a repeating decode batch's tokens in arrays
changes nothing anyone can observe, step by step, whatever ends the run."""

from __future__ import annotations

import pytest
from engine_utils import prompts, small_model

from paged import Engine, EngineConfig, SamplingParams
from paged.decode_run import sync


def _engine(runs: bool, monkeypatch, **overrides) -> Engine:
    cfg, params = small_model()
    base = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                attention_impl="xla", debug_checks=False)  # no debug: runs stay lazy across steps
    base.update(overrides)
    engine = Engine(EngineConfig(**base), model_config=cfg, params=params)
    if not runs:  # the per-step path only: a run is never started
        monkeypatch.setattr(engine, "_start_run", lambda *a: None)
    return engine


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    """Decoders that end at different steps: by length, by a stop id, by EOS, or not at all."""
    ps = prompts(6, seed=4, min_len=3, max_len=20)
    kinds = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, seed=5, stop_token_ids=(7, 9, 11, 13)),
        SamplingParams(max_tokens=40, temperature=1.0, seed=6),  # EOS may end it
        SamplingParams(max_tokens=17, temperature=0.7, top_k=20, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True),
    ]
    return [(f"r{i}", p, k) for i, (p, k) in enumerate(zip(ps, kinds))]


def _fields(out, tokens_first: bool = True) -> tuple:
    """What an output says, less the wall-clock times (each engine has its own). Either reader
    may be the first to see a lagging sequence."""
    if tokens_first:
        samples = [(o.index, o.token_ids, o.finish_reason) for o in out.outputs]
        times = out.token_times
    else:
        times = out.token_times
        samples = [(o.index, o.token_ids, o.finish_reason) for o in out.outputs]
    assert times == sorted(times) and len(times) == len(samples[0][1])
    return (out.request_id, out.finished, out.num_preemptions, out.num_cached_tokens,
            out.prompt_token_ids, out.finish_time is None, samples)


def _drive(engine: Engine, actions=None) -> list[list]:
    """Steps to the end; returns every step's outputs (read immediately for odd requests, at the
    end for even ones: an output read late must still be its step's snapshot)."""
    for rid, prompt, params in _requests():
        engine.add_request(rid, prompt, params)
    steps, late = [], []
    while engine.has_unfinished_requests():
        if actions and engine.num_steps in actions:
            actions[engine.num_steps](engine)
        outs = engine.step()
        late.append(outs)
        odd = engine.num_steps % 2
        steps.append([_fields(o, odd) for o in outs if int(o.request_id[1:]) % 2])
    for outs, now in zip(late, steps):
        now += [_fields(o) for o in outs if not int(o.request_id[1:]) % 2]
    return steps


def test_runs_change_no_output(monkeypatch):
    lazy, eager = _engine(True, monkeypatch), _engine(False, monkeypatch)
    got, want = _drive(lazy), _drive(eager)
    assert got == want
    assert lazy.num_run_steps >= 10 and eager.num_run_steps == 0
    assert lazy.block_manager.num_used_blocks == 0


def _tokens_by_request(steps) -> dict:
    last = {}
    for step in steps:
        for f in step:
            last[f[0]] = (f[-1][0][1], f[1])  # sample 0's tokens, finished
    return last


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_a_run(monkeypatch, mode):
    """A pool that runs dry while the batch decodes: the scheduler syncs the run before it picks
    and preempts a victim."""
    kw = dict(num_blocks=14, preemption_mode=mode)
    lazy, eager = _engine(True, monkeypatch, **kw), _engine(False, monkeypatch, **kw)
    got, want = _tokens_by_request(_drive(lazy)), _tokens_by_request(_drive(eager))
    assert got == want
    assert lazy.kv_stats()["num_preemptions"] > 0 and lazy.num_run_steps > 0
    lazy.block_manager.check_invariants()
    assert lazy.block_manager.num_used_blocks == 0


def test_abort_in_a_run(monkeypatch):
    def abort(engine):
        assert engine.abort("r0") and engine.abort("r5")

    lazy, eager = _engine(True, monkeypatch), _engine(False, monkeypatch)
    got, want = _drive(lazy, {12: abort}), _drive(eager, {12: abort})
    assert _tokens_by_request(got) == _tokens_by_request(want)
    assert lazy.num_run_steps > 0
    [aborted] = [f for f in got[12] if f[0] == "r5"]  # reported first in the next step
    assert aborted[1] and aborted[-1][0][2] == "abort"
    assert lazy.block_manager.num_used_blocks == 0


def test_debug_checks_pass_with_runs(monkeypatch):
    engine = _engine(True, monkeypatch, debug_checks=True)
    assert _tokens_by_request(_drive(engine)) == _tokens_by_request(
        _drive(_engine(False, monkeypatch)))
    assert engine.num_run_steps > 0


def test_a_lagging_sequence_syncs_on_demand(monkeypatch):
    engine = _engine(True, monkeypatch)
    engine.add_request("a", prompts(1, seed=9)[0], SamplingParams(max_tokens=30, ignore_eos=True))
    while engine.num_run_steps < 5:
        [out] = engine.step()
    [seq] = engine.scheduler.running
    assert seq.run is not None
    lagging = len(seq.token_ids)
    synced = list(sync(seq).token_ids)  # before the output is read (reading syncs too)
    assert lagging < len(synced) and synced == out.prompt_token_ids + out.token_ids
    assert seq.num_computed_tokens == len(synced) - 1
    assert len(seq.token_times) == len(out.token_ids)


def test_timeout_in_a_run(monkeypatch):
    """A request that times out while its batch is in a run reports every token it got."""
    import time

    lazy = _engine(True, monkeypatch, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ps = prompts(3, seed=11)
    # The whole run once (it compiles every shape, so the timeout below falls inside the run).
    want = lazy.generate(ps, params)[0].token_ids
    for i, p in enumerate(ps):
        lazy.add_request(f"t{i}", p, params, timeout_s=30.0 if i else 1.0)  # fresh ids
    start, base = time.perf_counter(), lazy.num_run_steps
    while lazy.num_run_steps < base + 3:
        last = {o.request_id: o for o in lazy.step()}["t0"]  # read after the timeout
    assert lazy.has_unfinished_requests() and time.perf_counter() - start < 1.0
    time.sleep(1.05 - (time.perf_counter() - start))
    outs = {o.request_id: o for o in lazy.step()}
    got = outs["t0"]
    assert got.finished and got.outputs[0].finish_reason == "timeout"
    assert got.token_ids == last.token_ids == want[:len(got.token_ids)]  # nothing lost or added
    assert 3 < len(got.token_ids) < len(want) and got.token_times == last.token_times
