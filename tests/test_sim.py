"""The simulator runs the real host code: deterministic, replays a real run's schedule exactly,
exercises preemption / swap / abort / timeout, keeps its evidence label apart; the fit and the
router behave as documented."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from paged import Engine, EngineConfig
from paged.fleet.routing import Router, cached_prefix_tokens
from paged.kv.block_manager import BlockManager
from paged.sim import (
    H200,
    LLAMA3_8B,
    LinearStepModel,
    ReplayStepModel,
    RooflineStepModel,
    Simulator,
    StepShape,
    check_not_mixed,
    fit_linear,
    simulate,
)
from paged.workload import metrics
from paged.workload import workload as wl
from paged.workload.engine_replay import replay_arrivals
from tests.engine_utils import small_model

MODEL = LinearStepModel({"const": 2e-3, "tokens": 2e-5, "seqs": 1e-5, "kv_read": 1e-7})


def _config(**kw) -> EngineConfig:
    base = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 64,
            "block_size": 8, "async_scheduling": False}
    base.update(kw)
    return EngineConfig(**base)


def _workload(num=24, rate=40.0, seed=0, **kw):
    return wl.make_workload("sharegpt", num, rate, max_model_len=128, seed=seed, **kw)


def _key(res):
    return [(r.request_id, r.status, r.first_token_s, r.finish_s, r.output_len, r.token_times,
             r.num_preemptions, r.num_cached_tokens) for r in res.records]


def test_deterministic_and_light_batch_equals_real_build():
    w = _workload(num=30, rate=200.0)
    a = simulate(_config(num_blocks=20), MODEL, w, record_schedule=True)
    b = simulate(_config(num_blocks=20), MODEL, w, record_schedule=True)
    c = simulate(_config(num_blocks=20), MODEL, w, record_schedule=True, build_device=False)
    assert _key(a) == _key(b) == _key(c)
    assert a.schedule == b.schedule == c.schedule
    assert a.summary["completed"] == 30 and a.summary["engine_preemptions"] > 0
    assert all(r.output_len == s.output_len for r, s in zip(a.records, w.requests))
    assert a.summary["evidence"] == "simulated"


def _record_real_run(engine: Engine, workload: wl.Workload):
    """Runs the real engine serially; the clock advances by each step's measured wall time
    (arrivals are admitted against it, an idle engine jumps to the next arrival). Returns the
    step durations and, per step, the requests run with their tokens and the preempted ones."""
    log = []
    inner = engine.scheduler.schedule

    def schedule(now):
        out = inner(now)
        if not out.is_empty:
            ib = engine.batch
            ran = [(ib.seqs[r].request_id, 1) for r in out.decode_rows.tolist()]
            ran += [(it.seq.request_id, it.num_new_tokens) for it in out.scheduled]
            log.append((ran, [s.request_id for s in out.preempted]))
        return out

    engine.scheduler.schedule = schedule
    durations, starts = [], []

    def ran(start, d):
        starts.append(start)
        durations.append(d)

    replay_arrivals(engine, workload.requests, ran)
    assert len(durations) == len(log)  # a step ran exactly when the scheduler scheduled one
    return durations, starts, log


def test_replaying_a_real_runs_step_times_reproduces_its_schedule():
    cfg = _config(num_blocks=20, min_token_bucket=64, min_seq_bucket=8)  # one compiled shape
    model_config, params = small_model()
    engine = Engine(cfg, model_config=model_config, params=params)
    w = _workload(num=16, rate=400.0, seed=3)
    durations, starts, real_log = _record_real_run(engine, w)
    assert engine.scheduler.num_preemptions > 0  # the pool is small: preemption is replayed too
    res = Simulator(cfg, ReplayStepModel(durations), model_config=model_config,
                    record_schedule=True).run(w)
    sim_log = res.schedule[0]
    assert [(ran, pre) for _, ran, pre in sim_log] == real_log
    assert [t for t, _, _ in sim_log] == starts
    assert res.summary["completed"] == 16


def test_preemption_swap_abort_and_timeout_paths():
    w = _workload(num=30, rate=200.0, seed=1)
    swap = simulate(_config(num_blocks=20, preemption_mode="swap"), MODEL, w)
    assert swap.replicas[0]["num_swap_outs"] > 0
    assert swap.summary["completed"] == 30
    rec = simulate(_config(num_blocks=20), MODEL, w)
    assert rec.summary["engine_preemptions"] > 0 and rec.replicas[0]["num_swap_outs"] == 0
    ids = [r.request_id for r in w.requests]
    late = w.requests[5].arrival_s + 0.004  # while it runs
    res = simulate(_config(), MODEL, w, aborts={ids[0]: 0.001, ids[5]: late, "unknown": 0.0})
    by_id = {r.request_id: r for r in res.records}
    assert by_id[ids[0]].status == "aborted" and by_id[ids[5]].status == "aborted"
    assert res.summary["completed"] == 28
    short = simulate(_config(), MODEL, w, timeout_s=0.05)
    assert short.summary["num_timeout"] > 0
    assert short.summary["num_timeout"] + short.summary["completed"] == 30
    cut = simulate(_config(), MODEL, w, max_time_s=0.05)
    assert cut.summary["completed"] < 30
    assert {r.status for r in cut.records} <= {"finished", "aborted", "rejected"}


def _ff_pair(cfg, w, model=MODEL, num_replicas=1, policy="least_loaded", idle_wake_s=0.0,
             **run_kw):
    """The same run stepped and fast-forwarded: records, schedules, counters and block-manager
    statistics must be equal."""
    out = []
    for ff in (False, True):
        sim = Simulator(cfg, model, num_replicas=num_replicas, router=Router(policy),
                        build_device=False, record_schedule=True, fast_forward=ff,
                        idle_wake_s=idle_wake_s)
        res = sim.run(w, **run_kw)
        out.append((res, [r.block_manager.stats() for r in sim.replicas],
                    sum(r.num_fast_steps for r in sim.replicas)))
    (a, bm_a, ff_a), (b, bm_b, ff_b) = out
    assert ff_a == 0 and ff_b > 0  # the fast path ran
    assert _key(a) == _key(b)
    assert a.schedule == b.schedule
    assert bm_a == bm_b
    drop = ("num_fast_forward_steps",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in a.replicas] == \
        [{k: v for k, v in r.items() if k not in drop} for r in b.replicas]
    assert a.routed == b.routed and a.router == b.router
    return a


def test_fast_forward_gives_the_schedule_of_stepping():
    w = _workload(num=40, rate=60.0, seed=2, shared_prefix_len=16)
    ids = [r.request_id for r in w.requests]
    # Preemption with prefix caching (recomputed requests meet their own cached blocks).
    res = _ff_pair(_config(num_blocks=24, enable_prefix_caching=True), w)
    assert res.summary["engine_preemptions"] > 0 and res.summary["prefix_cache_hit_tokens"] > 0
    _ff_pair(_config(num_blocks=20, preemption_mode="swap"), w)
    # Aborts mid-stretch, the time limit mid-stretch, a late idle wake-up.
    _ff_pair(_config(), w, aborts={rid: 0.2 + 0.03 * i for i, rid in enumerate(ids[::4])})
    # An abort just after an arrival cut a stretch short: the step in flight resumes without
    # the request that came after it began.
    _ff_pair(_config(), w, aborts={ids[i]: w.requests[i + 1].arrival_s + 1e-4
                                   for i in range(0, 39, 3)})
    _ff_pair(_config(), w, max_time_s=0.61)
    _ff_pair(_config(), _workload(num=20, rate=10.0, seed=4), idle_wake_s=0.001)
    # A stretch that finishes every running request leaves the replica idle: the next step is
    # priced as one after a pause.
    idle = LinearStepModel({**MODEL.coef, "after_idle": 3e-3})
    _ff_pair(_config(), _workload(num=20, rate=10.0, seed=4), model=idle)
    # Routers, prefix-aware among them (it reads every block manager).
    for policy in ("round_robin", "least_loaded", "prefix_aware"):
        _ff_pair(_config(enable_prefix_caching=True), w, num_replicas=3, policy=policy)
    # The roofline's decode times equal its per-step times, bit for bit.
    rm = RooflineStepModel(H200, LLAMA3_8B, block_size=8)
    _ff_pair(_config(), _workload(num=30, rate=200.0, seed=5), model=rm, num_replicas=2)
    assert rm.decode_times(7, 900, 5, 8, 8) == [
        rm.time(StepShape(num_tokens=7, num_seqs=7, num_decode=7, kv_read=900 + 7 * j,
                          attn_pairs=900 + 7 * j, num_samples=7, padded_tokens=8, padded_seqs=8))
        for j in range(5)]


def _continued_plans_checked(monkeypatch) -> list:
    """Every stretch a replica continues through a finish (``SimReplica.continue_at``, planned
    without the per-row checks) is checked equal to the plan from scratch, with the checks;
    returns a list that gets the start time of each continued stretch."""
    from paged.sim import replica as replica_mod
    from paged.sim import stretch
    fields = ("n", "k", "starts", "ends", "durs", "evict_from", "finishes")
    continued = []

    def checked(*args, steady=False, **kw):
        st = stretch.plan_stretch(*args, steady=steady, **kw)
        if steady:
            fresh = stretch.plan_stretch(*args, steady=False, **{**kw, "pads": None})
            assert (st is None) == (fresh is None)
            if st is not None:
                assert all(getattr(st, f) == getattr(fresh, f) for f in fields)
                assert (st.toks == fresh.toks).all() and (st.nt0 == fresh.nt0).all()
                assert (st.end_times == fresh.end_times).all()
                continued.append(kw["now"])
        return st

    monkeypatch.setattr(replica_mod, "plan_stretch", checked)
    return continued


@pytest.mark.parametrize("seed", [11, 12, 13, 14, 15])
def test_fast_forward_equals_stepping_on_random_fleets(seed, monkeypatch):
    # Random pools, batch limits, rates, shared prefixes, fleet sizes and routers: stretches
    # (cut by arrivals, ended by finishes and short pools, continued through finishes) leave
    # what stepping leaves.
    continued = _continued_plans_checked(monkeypatch)
    rng = random.Random(seed)
    cfg = _config(num_blocks=rng.choice([20, 32, 64]), max_num_seqs=rng.choice([4, 8]),
                  enable_prefix_caching=rng.random() < 0.7)
    w = _workload(num=30, rate=rng.choice([20.0, 60.0, 150.0]), seed=seed,
                  shared_prefix_len=rng.choice([0, 16]))
    _ff_pair(cfg, w, num_replicas=rng.choice([1, 2, 3]),
             policy=rng.choice(["least_loaded", "round_robin", "prefix_aware"]))
    assert continued  # stretches ran on through finishes


def test_stretches_continue_through_finishes_as_stepping(monkeypatch):
    # A slow arrival rate: stretches end at finishes with rows left and go on at once (priced
    # as steps that follow a step, not a pause), in a roomy and a small pool, on one replica and
    # behind a router that reads the block managers.
    continued = _continued_plans_checked(monkeypatch)
    idle = LinearStepModel({**MODEL.coef, "after_idle": 3e-3})
    w = _workload(num=24, rate=8.0, seed=21)
    for cfg in (_config(), _config(num_blocks=18, enable_prefix_caching=True)):
        _ff_pair(cfg, w, model=idle)
    _ff_pair(_config(), w, num_replicas=2, policy="prefix_aware")
    assert len(continued) > 10
    # A request that arrives exactly when a finish lets the stretch go on (the run is the same
    # up to then): it cuts the continued stretch before its first step.
    w = _workload(num=24, rate=40.0, seed=21)
    mark = len(continued)
    _ff_pair(_config(), w)
    f = continued[mark]
    j = next(i for i, r in enumerate(w.requests) if r.arrival_s > f)
    moved = list(w.requests)
    moved[j] = dataclasses.replace(moved[j], arrival_s=f)
    _ff_pair(_config(), wl.Workload("at_a_finish", moved, w.evidence, None))


def test_simulated_results_never_mix_with_real_or_constructed():
    res = simulate(_config(), MODEL, _workload(num=4))
    sim = res.summary
    assert sim["evidence"] == "simulated" and sim["workload_evidence"] == "constructed"
    assert check_not_mixed([sim, sim]) == "simulated"
    for other in ("real", "constructed"):
        with pytest.raises(ValueError, match="must not mix"):
            check_not_mixed([sim, {"evidence": other, "name": other}])
        with pytest.raises(ValueError, match="must not mix"):
            wl.check_same_evidence([{"evidence": other}, sim])
    real_like = metrics.summarize(res.records, duration_s=1.0, evidence="real")
    with pytest.raises(ValueError, match="must not mix"):
        check_not_mixed([real_like, sim])


def test_fit_rejects_a_grid_too_small_and_recovers_coefficients():
    rng = np.random.default_rng(0)
    shapes = [StepShape(num_tokens=int(t), num_seqs=int(s), kv_read=int(k))
              for t, s, k in zip(rng.integers(1, 256, 12), rng.integers(1, 32, 12),
                                 rng.integers(10, 5000, 12))]
    truth = LinearStepModel({"const": 1e-3, "tokens": 3e-5, "seqs": 2e-5, "kv_read": 4e-7})
    times = [truth.time(s) for s in shapes]
    with pytest.raises(ValueError, match="too small"):
        fit_linear(shapes[:5], times[:5])
    flat = [StepShape(num_tokens=s.num_tokens, num_seqs=4, kv_read=s.kv_read) for s in shapes]
    with pytest.raises(ValueError, match="rank"):
        fit_linear(flat, times)  # "seqs" never varies: const and seqs are not separable
    m = fit_linear(shapes, times)
    for k, v in truth.coef.items():
        assert m.coef[k] == pytest.approx(v, rel=1e-6)
    assert m.fit["max_abs_rel_error"] < 1e-9
    assert LinearStepModel.from_json(m.to_json()).coef == m.coef
    # The serving form: a step's prefill chunks (sequences that are not decodes) priced apart.
    chunks = rng.integers(0, 3, 12)  # prefill chunks per step
    mixed = [dataclasses.replace(s, num_decode=max(s.num_seqs - int(c), 0))
             for s, c in zip(shapes, chunks)]
    chunky = LinearStepModel({**truth.coef, "prefill_seqs": 1e-3})
    assert chunky.time(mixed[0]) == pytest.approx(
        truth.time(mixed[0]) + 1e-3 * (mixed[0].num_seqs - mixed[0].num_decode))
    m = fit_linear(mixed, [chunky.time(s) for s in mixed], (*truth.coef, "prefill_seqs"))
    assert m.coef["prefill_seqs"] == pytest.approx(1e-3, rel=1e-6)


def test_roofline_decode_is_bandwidth_bound():
    r = RooflineStepModel(H200, LLAMA3_8B)
    one = r.time(StepShape(num_tokens=1, num_seqs=1, num_decode=1, kv_read=100, num_samples=1))
    # ~16 GB of weights at 3.1 TB/s: about 5 ms, plus host and launch.
    assert 4.5e-3 < one < 6.5e-3
    big = r.time(StepShape(num_tokens=256, num_seqs=256, num_decode=256, kv_read=256 * 1000,
                           num_samples=256))
    assert big > one


class _Fake:
    def __init__(self, waiting, running, hit):
        self.num_waiting, self.num_running, self.hit = waiting, running, hit

    def cached_prefix_tokens(self, token_ids, cache_salt=None, probe=None):
        return self.hit


def test_router_policies():
    rr = Router("round_robin")
    reps = [_Fake(0, 0, 0) for _ in range(3)]
    assert [rr.route([1, 2], reps) for _ in range(4)] == [0, 1, 2, 0]
    ll = Router("least_loaded")
    assert ll.route([1], [_Fake(2, 3, 0), _Fake(0, 1, 0), _Fake(4, 0, 0)]) == 1
    idle = [_Fake(0, 0, 0) for _ in range(3)]
    assert [ll.route([1], idle) for _ in range(3)] == [2, 0, 1]  # ties rotate
    pa = Router("prefix_aware", load_threshold=4)
    # The holder of the longest prefix wins while it is within the threshold of the least loaded.
    assert pa.route([1], [_Fake(0, 1, 0), _Fake(2, 3, 64), _Fake(0, 2, 32)]) == 1
    # Past the threshold (load 10 vs 1): the least loaded.
    assert pa.route([1], [_Fake(0, 1, 0), _Fake(5, 5, 64), _Fake(0, 2, 32)]) == 0
    # Cold prompt: the least loaded.
    assert pa.route([1], [_Fake(3, 0, 0), _Fake(0, 1, 0), _Fake(0, 2, 0)]) == 1
    # Equal hits: the less loaded holder.
    assert pa.route([1], [_Fake(0, 0, 0), _Fake(0, 5, 64), _Fake(0, 2, 64)]) == 2
    assert pa.num_routed == {"prefix": 2, "overloaded": 1, "cold": 1}
    with pytest.raises(ValueError):
        Router("random")


def test_cached_prefix_query_is_side_effect_free_and_matches_admission():
    bm = BlockManager(32, 4, cache_salt="m")
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks
    bm.allocate("a", prompt)
    bm.mark_computed("a", 18)
    query = prompt[:13] + [99, 98, 97]  # shares 3 full blocks (12 tokens)
    before = (bm.stats(), bm._keyer.index.generation)
    assert cached_prefix_tokens(bm, query) == 12
    assert cached_prefix_tokens(bm, prompt) == 16
    assert cached_prefix_tokens(bm, query, cache_salt=b"other") == 0
    assert (bm.stats(), bm._keyer.index.generation) == before
    assert bm.allocate("b", query) == 12


def test_prefix_aware_routing_keeps_shared_prefixes_together():
    w = wl.make_workload("alpaca", 64, 200.0, max_model_len=128, seed=2, shared_prefix_len=32)
    hits = {}
    for policy in ("round_robin", "prefix_aware"):
        res = simulate(_config(), MODEL, w, num_replicas=4, router=Router(policy))
        assert sum(res.routed) == 64 and res.summary["completed"] == 64
        hits[policy] = res.summary["prefix_cache_hit_tokens"]
    assert hits["prefix_aware"] > hits["round_robin"]


def test_fleet_smoke_runs_and_labels_everything_simulated(tmp_path):
    import json

    from experiments import fleet
    from experiments.configs import fleet as fleet_config

    c = fleet_config.get_config("smoke")
    c.studies = ("block_size", "replicas", "speed", "point")
    c.point_replicas, c.point_rate = 3, 40.0
    c.block_sizes = (16,)
    c.replicas = (1, 2)
    c.routers = ("round_robin", "prefix_aware")
    c.max_requests = 120
    c.bisect_steps = 0
    c.speed_requests = (40, 80)
    c.output_dir = str(tmp_path)
    fleet.main(c, fleet.check(c))
    payload = json.loads((tmp_path / "fleet.json").read_text())
    assert payload["evidence"] == "simulated"
    res = payload["results"]["Llama-3-8B"]
    assert [a["arm"] for a in res["replicas"]] == ["1x least_loaded", "2x round_robin",
                                                   "2x prefix_aware"]
    assert all(p["evidence"] == "simulated" for a in res["replicas"] for p in a["points"])
    speed = res["speed"]  # the smallest size stepped too: the same records
    assert [(r["num_requests"], r["fast_forward"]) for r in speed] == [(40, False), (40, True),
                                                                        (80, True)]
    assert speed[0]["records_sha256"] == speed[1]["records_sha256"]
    point = res["point"]  # one what-if: 3 prefix-aware replicas at 40 req/s of tenant requests
    assert point["evidence"] == "simulated" and point["replicas"] == 3
    assert sum(point["routed"]) == point["summary"]["num_requests"] == 80
    assert point["summary"]["completed"] == 80 and point["summary"]["prefix_cache_hit_rate"] > 0
    for bad in ({"point_router": "nearest"}, {"point_replicas": 0}, {"point_workload": "chat"},
                {"point_rate": -1.0}):
        with pytest.raises(ValueError):
            fleet.check(_set(fleet_config.get_config("smoke"), **bad))


def _set(c, **kw):
    for k, v in kw.items():
        setattr(c, k, v)
    return c


@pytest.mark.slow
def test_calibrate_and_sim_validate_smoke(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for study in ("calibrate", "sim_validate"):
        proc = subprocess.run([sys.executable, "-m", f"experiments.{study}",
                               f"--config=experiments/configs/{study}.py:smoke",
                               f"--config.output_dir={tmp_path / study}"], cwd=root,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    cal = json.loads((tmp_path / "calibrate" / "calibration.json").read_text())
    assert set(cal["model"]["coef"]) == {"const", "tokens", "seqs", "kv_read"}
    val = json.loads((tmp_path / "sim_validate" / "sim_validate.json").read_text())
    assert val["evidence"] == {"real": "constructed", "sim": "simulated",
                               "real_repeat": "constructed"}
    assert val["points"][0]["sim_rel_error"]["p50_ttft_ms"] is not None
    assert val["points"][0]["real_repeat_rel_error"]["p50_ttft_ms"] is not None
    assert "real_repeat" in val["verdict"]
    # Each real run (a new engine each) left a record that replays exactly.
    from experiments import replay as rp

    out = tmp_path / "sim_validate"
    records = rp.load_records(str(out))
    assert len(records) == 2 * len(val["points"]) and all(r["fresh_engine"] for r in records)
    got = rp.replay(records[0])
    assert got.ok, f"{got.divergence.format()}\nreproduce: {rp.replay_command(out)}"


def test_bootstrap_interval_of_a_real_percentile():
    """``sim_validate.bootstrap_ci``: the interval holds the sample's own percentile, shrinks as
    the sample grows, covers the population percentile about 95 % of the time, and a figure far
    outside the spread is outside it; deterministic for a seed."""
    from experiments.sim_validate import bootstrap_ci, in_ci

    def records(ttfts):
        return [metrics.RequestRecord(
            request_id=f"r{i}", status="finished", arrival_s=0.0, first_scheduled_s=0.0,
            first_token_s=t, finish_s=t + 0.01, token_times=(t, t + 0.01), prompt_len=4,
            output_len=2) for i, t in enumerate(ttfts)]

    rng = np.random.default_rng(0)
    small = records(rng.exponential(0.003, 100))
    ci = bootstrap_ci(small, seed=1)
    own = float(np.percentile([r.ttft_s * 1e3 for r in small], 50))
    assert ci["p50_ttft_ms"][0] <= own <= ci["p50_ttft_ms"][1]
    assert ci == bootstrap_ci(small, seed=1)
    assert in_ci({"p50_ttft_ms": own, "p99_ttft_ms": 1e9}, ci) == {
        "p50_ttft_ms": True, "p99_ttft_ms": False, "p50_tpot_ms": False, "p99_tpot_ms": False}
    big = bootstrap_ci(records(rng.exponential(0.003, 1600)), seed=1)
    width = lambda c: c["p50_ttft_ms"][1] - c["p50_ttft_ms"][0]
    assert width(big) < 0.5 * width(ci)  # ~1/sqrt(16) of it
    true_p50 = 3.0 * np.log(2)  # ms, exponential with mean 3 ms
    hits = sum(lo <= true_p50 <= hi for lo, hi in (
        bootstrap_ci(records(rng.exponential(0.003, 200)), seed=s, n=400)["p50_ttft_ms"]
        for s in range(100)))
    assert 85 <= hits <= 100  # nominal 95 %
    assert bootstrap_ci(records([0.001]), seed=0)["p50_ttft_ms"] is None
