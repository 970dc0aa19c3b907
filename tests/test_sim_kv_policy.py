"""The simulator runs a KV policy's host bookkeeping as the engine does (docs/kv-policies.md):
the same calls, the same tokens dropped and blocks freed, the same schedule, for the same
requests; the compactions are priced (as copies of their regions)."""

from __future__ import annotations

import pytest
from engine_utils import prompts, small_model

from paged import Engine, EngineConfig, SamplingParams
from paged.config.kv_policy import KVPolicyConfig
from paged.sim.linear_model import LinearStepModel
from paged.sim.replica import SimReplica

# A pool that binds (preemption by recompute replays the policy in both).
BASE = dict(block_size=4, max_num_seqs=6, max_model_len=64, max_num_batched_tokens=32,
            min_token_bucket=32, min_seq_bucket=4, num_blocks=20, async_scheduling=False)
SP = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
POLICIES = [KVPolicyConfig("streaming_llm", budget=12, sink_tokens=2, interval=4),
            KVPolicyConfig("knorm", budget=0.5, interval=3),
            KVPolicyConfig("knorm", budget=9),
            KVPolicyConfig("h2o", budget=12, recent_tokens=4, interval=4),
            KVPolicyConfig("snapkv", budget=0.5, window=4),
            KVPolicyConfig("pyramidkv", budget=10, window=4)]


def _engine_run(cfg, ps):
    model, params = small_model()
    engine = Engine(cfg, model_config=model, params=params)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, SP)
    sched = []
    while engine.has_unfinished_requests():
        engine.step()
        sched.append(engine.kv_stats()["kv_policy"]["pages_freed"])
    return engine.kv_stats(), sched


def _sim_run(cfg, ps, model=None):
    rep = SimReplica(cfg, LinearStepModel({"const": 1e-3, "copy_blocks": 1e-4}),
                     model_config=model or small_model()[0], build_device=False,
                     record_schedule=True)
    for i, p in enumerate(ps):
        rep.add_request(str(i), p, SP, arrival_time=0.0)
    now, sched = 0.0, []
    while rep.has_unfinished_requests():
        dur, _ = rep.begin(now)
        assert dur is not None
        now += dur
        rep.finish(now)
        sched.append(rep.stats().get("kv_policy", {}).get("pages_freed", 0))
    return rep, sched


@pytest.mark.parametrize("pol", POLICIES, ids=lambda p: f"{p.method}-{p.budget}-{p.interval}")
def test_engine_and_simulator_free_the_same_blocks(pol):
    ps = prompts(6, seed=3, min_len=14, max_len=40)
    cfg = EngineConfig(**BASE, kv_policy=pol)
    stats, eng_sched = _engine_run(cfg, ps)
    rep, sim_sched = _sim_run(cfg, ps)
    got = rep.stats()
    assert got["kv_policy"] == stats["kv_policy"]
    assert got["kv_policy"]["pages_freed"] > 0
    assert got["num_preemptions"] > 0 or pol.method != "knorm"  # the pool binds
    assert sim_sched == eng_sched  # freed after the same step, step by step
    assert got["num_preemptions"] == stats["num_preemptions"]
    assert got["peak_used_blocks"] == stats["block_manager"]["peak_used_blocks"]


def test_compactions_are_priced_and_no_policy_is_unchanged():
    """A policy's compactions are priced (the step model sees their blocks); with
    ``full`` (drops nothing) and a pool that does not bind (a recompute's chunk would end at
    the policy point) the simulator's schedule and time equal no policy's."""
    ps = prompts(6, seed=3, min_len=14, max_len=40)
    roomy = {**BASE, "num_blocks": 128}
    base, _ = _sim_run(EngineConfig(**roomy), ps)
    full, _ = _sim_run(EngineConfig(**roomy, kv_policy=KVPolicyConfig("full")), ps)
    assert full.schedule_log == base.schedule_log and full.busy_s == base.busy_s
    pol, _ = _sim_run(EngineConfig(**roomy, kv_policy=POLICIES[2]), ps)
    assert pol.stats()["kv_policy"]["compactions"] > 0
    assert pol.busy_s - 1e-3 * pol.num_steps > 1e-4 * pol.stats()["kv_policy"]["pages_freed"]
