"""The overlapped step (``async_scheduling``): step k+1 is dispatched before step k is read back.

What a user sees must not change: every request's sequence of outputs is the same with overlap on
and off, whatever ends it (length, stop ids, EOS, abort, timeout, preemption by recompute or
swap), no token after a stop ever reaches an output, and nothing leaks.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from engine_utils import prompts, small_model

from paged import Engine, EngineConfig, SamplingParams


def _engine(overlap: bool, **overrides) -> Engine:
    cfg, params = small_model()
    base = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                attention_impl="xla", async_scheduling=overlap)
    base.update(overrides)
    # One token and one sequence bucket: few step shapes to compile (bucketing is tested apart).
    base.setdefault("min_token_bucket", base["max_num_batched_tokens"])
    base.setdefault("min_seq_bucket", base["max_num_seqs"])
    return Engine(EngineConfig(**base), model_config=cfg, params=params)


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    """Requests that end at different steps: by length, a stop id, EOS, or not at all; one with
    parallel samples."""
    ps = prompts(7, seed=4, min_len=3, max_len=20)
    kinds = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, seed=5, stop_token_ids=(7, 9, 11, 13)),
        SamplingParams(max_tokens=40, temperature=1.0, seed=6),  # EOS may end it
        SamplingParams(max_tokens=17, temperature=0.7, top_k=20, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=8, n=3, ignore_eos=True),
    ]
    return [(f"r{i}", p, k) for i, (p, k) in enumerate(zip(ps, kinds))]


def _fields(out) -> tuple:
    samples = tuple((o.index, tuple(o.token_ids), o.finish_reason) for o in out.outputs)
    times = out.token_times
    assert times == sorted(times) and len(times) == len(samples[0][1])
    return (out.finished, out.num_preemptions, tuple(out.prompt_token_ids), samples)


def _drive(engine: Engine, actions=None, requests=None) -> dict[str, list]:
    """Steps to the end; returns each request's outputs in order (half read at once, half at the
    end: an output read late must still be its step's snapshot)."""
    for rid, prompt, params in requests or _requests():
        engine.add_request(rid, prompt, params)
    seen: dict[str, list] = {}
    late = []
    calls = 0
    while engine.has_unfinished_requests() or engine.has_step_in_flight():
        if actions and calls in actions:
            actions[calls](engine)
        for out in engine.step():
            if int(out.request_id[1:]) % 2:
                seen.setdefault(out.request_id, []).append(_fields(out))
            else:
                late.append(out)
        calls += 1
    for out in late:
        seen.setdefault(out.request_id, []).append(_fields(out))
    assert engine.block_manager.num_used_blocks == 0 and engine.batch.num_rows == 0
    return seen


def _final(seen: dict[str, list]) -> dict[str, tuple]:
    """Each request's last output, less its preemption count."""
    return {r: (h[-1][0], *h[-1][2:]) for r, h in seen.items()}


def _dedupe(history: list) -> list:
    """A request's distinct snapshots in order (a step may report a request without news)."""
    return [h for i, h in enumerate(history) if not i or h != history[i - 1]]


def test_overlap_changes_no_output():
    on, off = _engine(True), _engine(False)
    got, want = _drive(on), _drive(off)
    assert {r: _dedupe(h) for r, h in got.items()} == {r: _dedupe(h) for r, h in want.items()}
    for history in got.values():  # reported finished exactly once, at the end
        assert [h[0] for h in history].count(True) == 1 and history[-1][0]


def test_a_late_stop_never_leaks_a_token():
    """The stop is seen one step late: that step computed a token for the stopped sequence,
    which is dropped (and its slot freed)."""
    engine = _engine(True)
    p = prompts(1, seed=3)[0]
    free = engine.generate([p], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    engine.add_request("s", p, params)
    outs = []
    while engine.has_unfinished_requests() or engine.has_step_in_flight():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert outs[-1].token_ids == free.token_ids[:first + 1]
    assert all(len(o.token_ids) <= first + 1 for o in outs)
    assert [o.finished for o in outs].count(True) == 1
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_while_a_step_is_in_flight(mode):
    kw = dict(num_blocks=14, preemption_mode=mode)
    on, off = _engine(True, **kw), _engine(False, **kw)
    got, want = _drive(on), _drive(off)
    # Which sequence is preempted when may differ (the overlapped scheduler sees a step ahead);
    # what each request generates may not.
    assert _final(got) == _final(want)
    assert on.kv_stats()["num_preemptions"] > 0
    on.block_manager.check_invariants()


def test_abort_while_a_step_is_in_flight():
    def abort(engine):
        assert engine.has_step_in_flight()
        assert engine.abort("r0") and engine.abort("r5")

    full = _drive(_engine(False))
    got = _drive(_engine(True), {12: abort})
    for rid in ("r0", "r5"):
        last = got[rid][-1]
        assert last[0] and last[-1][0][2] == "abort"
        want = full[rid][-1][-1][0][1]
        assert want[:len(last[-1][0][1])] == last[-1][0][1]  # a prefix: nothing added
        assert len(last[-1][0][1]) < len(want)
    for rid in ("r1", "r2", "r3"):
        assert got[rid][-1] == full[rid][-1]


def test_timeout_while_a_step_is_in_flight():
    engine = _engine(True, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ps = prompts(3, seed=11)
    want = engine.generate(ps, params)[0].token_ids  # compiles every shape first
    for i, p in enumerate(ps):
        engine.add_request(f"t{i}", p, params, timeout_s=30.0 if i else 1.0)
    start = time.perf_counter()
    last = None
    while last is None or len(last.token_ids) < 4:
        last = {o.request_id: o for o in engine.step()}.get("t0", last)
    assert engine.has_step_in_flight() and time.perf_counter() - start < 1.0
    time.sleep(1.05 - (time.perf_counter() - start))
    outs = {o.request_id: o for o in engine.step()}
    got = outs["t0"]
    assert got.finished and got.outputs[0].finish_reason == "timeout"
    assert want[:len(got.token_ids)] == got.token_ids and len(got.token_ids) >= len(last.token_ids)
    while engine.has_unfinished_requests() or engine.has_step_in_flight():
        assert "t0" not in {o.request_id for o in engine.step()}  # reported once
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("quarantine", [1, 0])
def test_poisoned_pages_never_reach_an_output(quarantine):
    """Debug mode NaN-poisons every page whose content died; with overlap on, pages freed while
    a step that reads them is in flight are held by the quarantine window (counted), and the
    outputs equal a run without overlap."""
    kw = dict(debug_checks=True, num_blocks=16, quarantine_steps=quarantine)
    on = _engine(True, **kw)
    got = _drive(on)
    want = _drive(_engine(False, **kw))
    assert _final(got) == _final(want)
    held = on.block_manager.stats()["quarantined"]
    assert (held > 0) if quarantine else held == 0


def test_overlap_takes_the_fed_path_and_the_batched_decodes():
    """Steady decoding with overlap on: the next step's input tokens come from the device."""
    engine = _engine(True)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(4, seed=2)):
        engine.add_request(f"q{i}", p, params)
    fed = 0
    while engine.has_unfinished_requests() or engine.has_step_in_flight():
        engine.step()
        if engine.has_step_in_flight():
            fed = max(fed, int((np.asarray(engine._inflight.batch.device.feed) >= 0).sum()))
    assert fed == 4
    assert engine.scheduler.num_fast_decode_steps >= 15


def test_blocks_keyed_from_fed_tokens_hit_correctly():
    """Decode blocks are keyed with token ids that arrived a step late (``set_tokens``): a later
    prompt made of a prompt and its generated text hits those blocks, and its continuation equals
    that of an engine without a prefix cache."""
    on = _engine(True)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    first = on.generate(prompts(3, seed=21, min_len=5, max_len=12), params)
    follow = [o.prompt_token_ids + o.token_ids[:25] for o in first]
    before = on.kv_stats()["prefix_cache_hit_tokens"]
    got = on.generate(follow, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert on.kv_stats()["prefix_cache_hit_tokens"] - before >= 3 * 8 * 2  # decode blocks hit
    cold = _engine(False, enable_prefix_caching=False)
    want = cold.generate(follow, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
