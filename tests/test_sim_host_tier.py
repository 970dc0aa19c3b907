"""The simulator's host KV tier: the engine's tier bookkeeping, priced on a host-device link.

Hand-computed seconds on tiny dims (256 bytes per block), host hits that shrink the prefill, the
tier's byte bound, fast-forward equal to stepping with the tier, and runs without a tier unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest

# TINY: L=2, Hkv=2, D=4, bf16: 64 KV bytes per token, 256 per 4-token block. Recorder: 1 ms
# per step, keeps every shape.
from test_sim_kv_whatifs import TINY, Recorder

from paged import EngineConfig, SamplingParams
from paged.sim import RooflineStepModel, Simulator
from paged.sim.host_link import NVLINK_C2C, PCIE5_X16, HostLink, TierPricer
from paged.sim.replica import SimReplica
from paged.sim.specs import DeviceSpec
from paged.workload.workload import RequestSpec, Workload

BPB = 256
# 1 ms per MB host to device, 0.5 ms per MB device to host, 1 ms per copy.
LINK = HostLink("test", h2d_bandwidth=1e6, d2h_bandwidth=2e6, latency_s=1e-3)


def _config(**kw) -> EngineConfig:
    base = {"block_size": 4, "num_blocks": 5, "max_model_len": 16, "max_num_seqs": 4,
            "max_num_batched_tokens": 64, "async_scheduling": False}
    base.update(kw)
    return EngineConfig(**base)


def test_link_figures_and_pricer_by_hand():
    assert TINY.kv_bytes_per_block(4) == BPB
    assert PCIE5_X16.nominal_bandwidth == 64e9 and PCIE5_X16.h2d_bandwidth == 50e9
    assert NVLINK_C2C.nominal_bandwidth == 450e9 and NVLINK_C2C.d2h_bandwidth == 0.78 * 450e9
    p = TierPricer(LINK, BPB)
    assert [p.wire_bytes(n) for n in (0, 1, 2, 3, 5)] == [0, 256, 512, 1024, 2048]  # pow2 padded
    assert LINK.load_time(0) == LINK.offload_time(0) == 0.0
    assert LINK.load_time(1024) == pytest.approx(1e-3 + 1.024e-3)
    assert LINK.offload_time(1024) == pytest.approx(1e-3 + 0.512e-3)
    assert p.step_time(2e-3, 1e-3, 2.5e-3) == 3e-3  # the load before, the offload beside
    assert p.step_time(1e-3, 0.0, 2.5e-3) == 2.5e-3
    with pytest.raises(ValueError, match="h2d_bandwidth"):
        HostLink("x", 0.0, 1.0)
    with pytest.raises(ValueError, match="latency_s"):
        HostLink("x", 1.0, 1.0, -1.0)
    with pytest.raises(TypeError, match="HostLink"):
        TierPricer("pcie", BPB)


def test_load_and_offload_seconds_by_hand():
    """Pool of 4 blocks, tier of 8: request a (9 tokens: two full blocks cached), then b (its
    third block evicts one of a's: offloaded), then a again as c (one block still on the device,
    one loaded from the host)."""
    model = Recorder()
    rep = SimReplica(_config(host_kv_cache_bytes=8 * BPB + 100), model, model_config=TINY,
                     build_device=False, host_link=LINK)
    assert rep.host_tier_stats()["num_blocks"] == 8 and rep.host_tier_stats()["bytes"] == 8 * BPB
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    a, b = list(range(1, 10)), list(range(20, 29))
    t, durations, outs = 0.0, [], {}
    for rid, prompt in (("a", a), ("b", b), ("c", a)):
        rep.add_request(rid, prompt, params, arrival_time=t)
        while rep.has_unfinished_requests():
            d, _ = rep.begin(t)
            durations.append(d)
            t += d
            outs.update((o.request_id, o) for o in rep.finish(t))
    offload1 = 1e-3 + BPB / 2e6  # 1.128 ms: longer than b's 1 ms step, which waits for it
    load1 = 1e-3 + BPB / 1e6  # 1.256 ms
    # a: 1 ms; b: max(1 ms, offload); c: a copy-only step (its load, and the offload of the
    # block its admission evicted, beside it), then its prefill of the one token not cached.
    assert durations == pytest.approx([1e-3, offload1, max(load1, offload1), 1e-3])
    c = outs["c"]
    assert (c.num_cached_tokens, c.num_host_cached_tokens) == (8, 4)
    assert c.first_token_time - c.arrival_time == pytest.approx(load1 + 1e-3)  # TTFT has the wait
    assert [s.num_tokens for s in model.shapes] == [9, 9, 1]  # the loaded tokens not recomputed
    s = rep.host_tier_stats()
    assert (s["hits"], s["hit_tokens"], s["loaded_blocks"], s["offloaded_blocks"]) == (1, 4, 1, 2)
    assert s["load_s"] == pytest.approx(load1) and s["offload_s"] == pytest.approx(2 * offload1)
    assert (s["copy_only_steps"], s["offload_bound_steps"], s["num_loads"]) == (1, 1, 1)
    assert s["load_wait_s"] == pytest.approx(load1)
    assert (s["load_wire_bytes"], s["offload_wire_bytes"]) == (BPB, 2 * BPB)


def _turns(num_convs=6, turns=3, system=8, turn=8, output=4, gap=0.004) -> Workload:
    """Multi-turn conversations sent round by round: between two turns of one conversation the
    others pass through the pool (constructed)."""
    reqs, t = [], 0.0
    for k in range(1, turns + 1):
        for i in range(num_convs):
            prompt = tuple([256] + list(range(1, system))
                           + [(i * 31 + j) % 256 for j in range(k * turn)])
            reqs.append(RequestSpec(f"c{i}k{k}", t, prompt, None, len(prompt), output))
            t += gap
    return Workload("turns", tuple(reqs), "constructed", 0, {})


def _dev():
    return DeviceSpec(name="test", mem_bandwidth=1e9, flop_s=1e12, launch_s=1e-4)


@pytest.mark.parametrize("fast_forward", [False, True])
def test_tier_turns_evictions_into_hits_and_shrinks_prefill(fast_forward):
    w = _turns()
    sm = RooflineStepModel(_dev(), TINY, block_size=4)
    base = _config(num_blocks=14, max_model_len=48, debug_checks=not fast_forward)
    runs = {}
    for mult in (0, 4):
        cfg = dataclasses.replace(base, host_kv_cache_bytes=mult * 13 * BPB)
        res = Simulator(cfg, sm, model_config=TINY, build_device=False,
                        fast_forward=fast_forward, host_link=LINK).run(w)
        assert res.summary["completed"] == len(w)
        runs[mult] = res
    off, on = runs[0], runs[4]
    assert "host_tier" not in off.replicas[0] and "host_tier_hit_tokens" not in off.summary
    tier = on.replicas[0]["host_tier"]
    assert tier["hit_tokens"] > 0 and on.summary["host_tier_hit_tokens"] == tier["hit_tokens"]
    assert tier["num_blocks"] * BPB <= 4 * 13 * BPB  # the tier never exceeds its bytes
    assert tier["free"] + tier["cached"] + tier["writing"] + tier["held"] == tier["num_blocks"]
    assert on.replicas[0]["num_prefill_tokens"] < off.replicas[0]["num_prefill_tokens"]
    assert on.summary["prefix_cache_hit_tokens"] > off.summary["prefix_cache_hit_tokens"]
    assert tier["load_s"] > 0 and tier["offload_s"] > 0


def test_fast_forward_with_a_tier_equals_stepping():
    w = _turns(num_convs=5, turns=3, output=12, gap=0.01)
    sm = RooflineStepModel(_dev(), TINY, block_size=4)
    cfg = _config(num_blocks=14, max_model_len=48, host_kv_cache_bytes=40 * BPB)
    res = [Simulator(cfg, sm, model_config=TINY, build_device=False, fast_forward=ff,
                     host_link=LINK, record_schedule=True).run(w) for ff in (False, True)]
    assert [r.as_dict() for r in res[0].records] == [r.as_dict() for r in res[1].records]
    assert res[0].schedule == res[1].schedule
    assert res[0].replicas[0]["host_tier"] == res[1].replicas[0]["host_tier"]
    assert res[1].replicas[0]["num_fast_forward_steps"] > 0


def test_runs_without_a_tier_are_unchanged_by_a_link():
    w = _turns()
    sm = RooflineStepModel(_dev(), TINY, block_size=4)
    cfg = _config(num_blocks=14, max_model_len=48)
    plain = Simulator(cfg, sm, model_config=TINY, build_device=False).run(w)
    linked = Simulator(cfg, sm, model_config=TINY, build_device=False, host_link=NVLINK_C2C).run(w)
    assert [r.as_dict() for r in plain.records] == [r.as_dict() for r in linked.records]
    assert plain.replicas == linked.replicas


def test_tier_errors_are_clear():
    with pytest.raises(TypeError, match="ModelDims"):
        SimReplica(_config(host_kv_cache_bytes=4096), Recorder())  # the byte model: no KV dims
    with pytest.raises(ValueError, match="holds no block"):
        SimReplica(_config(host_kv_cache_bytes=BPB - 1), Recorder(), model_config=TINY)
    with pytest.raises(TypeError, match="HostLink"):
        SimReplica(_config(host_kv_cache_bytes=BPB), Recorder(), model_config=TINY,
                   host_link="pcie")
