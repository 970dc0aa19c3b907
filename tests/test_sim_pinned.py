"""The simulator's records are pinned: the sha256 of every record of a few fixed runs (token
times included) must not move when the simulator gets faster. The hashes were computed on the
code before the speed work of issue 24 (``12925f5``); a change that moves one changed what the
simulator computes, not only how fast."""

from __future__ import annotations

import hashlib
import json

import pytest

from paged import EngineConfig
from paged.fleet.routing import Router
from paged.sim import H200, LLAMA3_8B, RooflineStepModel, Simulator
from paged.workload import workload as wl


def _digest(res) -> str:
    """``experiments/fleet.py``'s ``records_sha256``."""
    return hashlib.sha256(json.dumps([r.as_dict() for r in res.records],
                                     default=str).encode()).hexdigest()[:16]


@pytest.mark.parametrize("policy, aborts, expected", [
    ("least_loaded", False, "94fd749cbc9468fc"),
    ("prefix_aware", True, "31adbb8484c4e335"),
])
def test_small_fleet_records_are_pinned(policy, aborts, expected):
    # 300 requests over 8 replicas, a tight pool (preemption), a shared prefix (prefix hits);
    # prefix-aware routing reads the block managers mid-stretch; every 17th request is aborted.
    cfg = EngineConfig(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512,
                       block_size=16, async_scheduling=False, num_blocks=120, model="sim",
                       dtype="bfloat16")
    w = wl.make_workload("sharegpt", 300, 300.0, max_model_len=1024, seed=1,
                         shared_prefix_len=64)
    ab = {r.request_id: r.arrival_s + 0.05 for r in w.requests[::17]} if aborts else None
    res = Simulator(cfg, RooflineStepModel(H200, LLAMA3_8B, block_size=16), num_replicas=8,
                    router=Router(policy), model_config=LLAMA3_8B, build_device=False).run(
                        w, aborts=ab)
    s = res.summary
    assert s["engine_preemptions"] > 200 and s["prefix_cache_hit_tokens"] > 40_000
    assert sum(r["num_fast_forward_steps"] for r in res.replicas) > 4000
    assert _digest(res) == expected


def test_speed_study_records_are_pinned():
    # The speed study's 10^3 point (experiments/fleet.py ``speed``): 64 replicas, least loaded.
    from experiments import common, fleet
    from experiments.configs.fleet import get_config
    from paged.sim.specs import MODELS

    c = get_config()
    base = common.make_engine_config(c.engine, model="sim")
    model = MODELS["Llama-3-8B"]
    sm = RooflineStepModel(fleet.device(c), model.with_kv_cache(base), block_size=base.block_size)
    cfg = fleet.engine_for(base, model, c.kv_gb)
    w = fleet.plain_workload(c, 1000, c.speed_rate_per_replica * 64, cfg.max_model_len)
    res = Simulator(cfg, sm, num_replicas=64, router=Router("least_loaded"),
                    model_config=sm.model, build_device=False).run(w)
    assert _digest(res) == "b84d4955e9ed10c6"
