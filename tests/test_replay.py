"""Exact replay of a serving run (experiments.replay): the record a serving run keeps re-executes
in lockstep to the same batches and tokens, and a deliberate change is caught at its step."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
from replay_utils import CONFIG, run_on_clock, workload

from experiments import common, serving
from experiments import replay as rp
from paged import Engine, EngineConfig


@functools.cache
def _recorded(**overrides):
    """One serving run with preemption, prefix hits, a timeout and aborts (the wall limit falls
    while later requests are still in flight: they are aborted). Its record is also written to a
    temporary results dir, so a failing assertion can print the command that replays it."""
    model = common.load_model("random-small")  # what the replay command loads by name
    engine = Engine(EngineConfig(**CONFIG, **overrides), model_config=model[0], params=model[1])
    result = run_on_clock("arm", engine, workload(16, 0.003), max_wall_s=0.06,
                          timeouts={"r05": 0.01})
    if not overrides:
        serving.write_replay(REPLAY_DIR / "replay.json", [result])
    return model, result


REPLAY_DIR = Path(tempfile.mkdtemp(prefix="test_replay_"))
HOW = f"reproduce: {rp.replay_command(REPLAY_DIR)}"


def test_serving_run_records_what_replay_needs():
    _, result = _recorded()
    record = result.replay
    statuses = {r.request_id: r.status for r in result.records}
    assert statuses["r05"] == "timeout", HOW
    assert "aborted" in statuses.values(), (statuses, HOW)
    assert result.summary["engine_preemptions"] > 0, HOW
    assert result.summary["prefix_cache_hit_tokens"] > 0, HOW
    # One entry per engine.step() call; a call that dispatched nothing is not counted in
    # num_engine_steps.
    assert len(record["steps"]) >= result.summary["num_engine_steps"] > 0
    added = [rid for s in record["steps"] for rid in s["added"]]
    assert added == [r["request_id"] for r in record["requests"]]
    ended = {rid for s in record["steps"] for rid in s["ended"]}
    assert ended == {rid for rid, st in statuses.items() if st in ("timeout", "aborted")}
    assert any(s["preempted"] for s in record["steps"])
    json.dumps(record)  # written as JSON


def test_replay_reproduces_tokens_and_batches():
    model, result = _recorded()
    record = json.loads(json.dumps(result.replay))  # as read back from replay.json
    got = rp.replay(record, model)
    assert got.ok, f"{got.divergence.format()}\n{HOW}"
    assert got.num_steps == len(record["steps"])
    finished = [rid for rid, st in record["statuses"].items() if st == "finished"]
    assert finished and all(len(record["tokens"][rid]) > 0 for rid in finished)


def _first_difference(record, model, **overrides) -> int:
    """The first step whose recorded composition differs from the lockstep run under
    ``overrides``, found without the replay's own comparison: the changed engine is driven
    through every recorded step and its log compared afterwards."""
    engine = Engine(rp.engine_config(record, **overrides), model_config=model[0],
                    params=model[1])
    log = engine.record_steps()
    reqs = {r["request_id"]: r for r in record["requests"]}
    for step in record["steps"]:
        for rid in step["added"]:
            r = reqs[rid]
            engine.add_request(rid, r["prompt"], serving.request_params(r["output_len"], r["n"]),
                               arrival_time=r["arrival_s"])
        for rid in step["ended"]:
            engine.abort(rid)
        engine.step()
    for k, (want, got) in enumerate(zip(record["steps"], log)):
        if json.loads(json.dumps(got["batch"])) != want["batch"] or got["ended"] != want["ended"]:
            return k
    raise AssertionError("the changed engine ran the same batches")


def test_changed_policy_is_caught_at_the_first_differing_step():
    model, result = _recorded()
    record = result.replay
    got = rp.replay(record, model, policy="prefill-first")
    assert not got.ok
    div = got.divergence
    assert div.step == _first_difference(record, model, policy="prefill-first")
    assert div.step > 0  # the first steps (one request, nothing to reorder) agree
    assert div.expected == record["steps"][div.step][div.field] and div.expected != div.got
    text = div.format()
    assert f"step {div.step}" in text and "recorded:" in text and "replayed:" in text


def test_changed_token_is_caught_in_the_final_tokens():
    model, result = _recorded()
    record = json.loads(json.dumps(result.replay))
    rid = next(r for r, st in record["statuses"].items() if st == "finished")
    record["tokens"][rid][-1] = (record["tokens"][rid][-1] + 1) % 256
    got = rp.replay(record, model)
    assert got.divergence.step is None and rid in got.divergence.field


def test_cli_replays_a_results_dir(tmp_path, capsys):
    _recorded()
    assert rp.main([f"--from={REPLAY_DIR}"]) == 0
    assert "[arm] identical" in capsys.readouterr().out
    # --sim: this run was overlapped, so the simulator refuses it in one line.
    with pytest.raises(SystemExit) as e:
        rp.main([f"--from={REPLAY_DIR}", "--sim"])
    assert e.value.code == 2 and "async_scheduling=False" in capsys.readouterr().err
    # A record whose tokens were not what this model makes: exit 1, both sides printed.
    payload = json.loads((REPLAY_DIR / "replay.json").read_text())
    record = payload["arms"][0]
    rid = next(r for r, st in record["statuses"].items() if st == "finished")
    record["tokens"][rid][0] = (record["tokens"][rid][0] + 1) % 256
    (tmp_path / "replay.json").write_text(json.dumps(payload))
    assert rp.main([f"--from={tmp_path}", "--arm=arm"]) == 1
    out = capsys.readouterr().out
    assert f"[arm] replay differs at final tokens (tokens of {rid})" in out
    assert "recorded:" in out and "replayed:" in out


@pytest.mark.parametrize("args, message", [
    ([], "--from=<results dir> is required"),
    (["--from=/nonexistent/dir"], "no such directory"),
    (["--from={tmp}"], "replay.json: no such file"),
    (["--from={tmp}", "--arm=x", "extra"], "unexpected arguments"),
    (["--bogus=1"], "bogus"),
])
def test_cli_mistakes_end_in_one_line(tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) as e:
        rp.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("replay: ") and message in err and "\n" not in err


def test_record_of_a_reused_engine_is_refused():
    _, result = _recorded()
    with pytest.raises(ValueError, match="started warm"):
        rp.check_record({**result.replay, "fresh_engine": False})


def test_record_checks():
    with pytest.raises(ValueError, match="lacks"):
        rp.check_record({"version": 1})
    with pytest.raises(ValueError, match="version"):
        rp.check_record({k: 0 for k in ("arm", "model", "engine_config", "requests", "steps",
                                        "tokens")} | {"version": 2})


def test_serial_run_replays_on_the_simulator_with_the_same_schedule():
    model, result = _recorded(async_scheduling=False)
    record = result.replay
    assert any(s["preempted"] for s in record["steps"])
    assert got_ok(rp.replay(record, model))  # the engine replays it exactly too
    assert got_ok(rp.replay_sim(record))
    # A changed policy is caught on the simulator too, at a step after the first.
    changed = rp.replay_sim(record, policy="prefill-first")
    assert not changed.ok and changed.divergence.step > 0
    # The overlapped run's schedule is not the serial one: refused, not compared.
    with pytest.raises(ValueError, match="async_scheduling=False"):
        rp.replay_sim(_recorded()[1].replay)


def got_ok(result) -> bool:
    assert result.ok, result.divergence.format()
    return True


def test_a_reused_engine_is_marked_not_fresh():
    model = common.load_model("random-small")
    engine = Engine(EngineConfig(**CONFIG), model_config=model[0], params=model[1])
    w = workload(2, 0.0)
    first = serving.run_arm("a", engine, w, progress=False)
    second = serving.run_arm("b", engine, w, progress=False)
    assert first.replay["fresh_engine"] and not second.replay["fresh_engine"]
    assert first.replay["workload"]["digest"] == second.replay["workload"]["digest"]
    assert rp.replay(first.replay, model).ok
    with pytest.raises(ValueError, match="started warm"):
        rp.replay(second.replay, model)
    # Emptied between runs (what a study reusing an engine does), the engine starts cold: the
    # third run replays exactly on a new engine, although this one served two runs before.
    assert serving.cold_start(engine) is False
    serving.start_cold(engine)
    assert serving.cold_start(engine) and engine.kv_stats()["num_cached_blocks"] == 0
    third = serving.run_arm("c", engine, w, progress=False)
    assert third.replay["fresh_engine"] and third.replay["tokens"] == first.replay["tokens"]
    assert got_ok(rp.replay(third.replay, model))


def test_reset_prefix_cache_refuses_while_requests_run():
    model = common.load_model("random-small")
    engine = Engine(EngineConfig(**CONFIG), model_config=model[0], params=model[1])
    engine.add_request("x", [256, 1, 2, 3], serving.request_params(4))
    assert engine.reset_prefix_cache() is False  # nothing changed: the request still runs
    with pytest.raises(RuntimeError, match="unfinished"):
        serving.start_cold(engine)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True
