"""The simulator's disaggregated fleet (``paged.sim.disagg``): prefill replicas never decode,
decode replicas never prefill, each hand-over moves the exact ``M_KV`` of its prompt over a link
and waits for decode-side room without deadlock, aborts in every phase free every block, and
decode replicas' fast-forward gives the schedule of stepping."""

from __future__ import annotations

import math

import pytest

from paged import EngineConfig
from paged.accounting.formulas import kv_bytes
from paged.fleet.routing import Router
from paged.sim import LLAMA3_8B, LinearStepModel, Simulator
from paged.sim.link_transport import IB_NDR_400, NVLINK4_H200, Link, LinkTransport
from paged.workload import workload as wl

MODEL = LinearStepModel({"const": 2e-3, "tokens": 2e-5, "seqs": 1e-5, "kv_read": 1e-7})
HANDOVER = LinkTransport(NVLINK4_H200, LLAMA3_8B)
SLOW = LinkTransport(Link("slow", 2e9, 1e-3), LLAMA3_8B)  # 65 ms per 1000 tokens: aborts land mid-copy


def _config(**kw) -> EngineConfig:
    base = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 64,
            "block_size": 8, "async_scheduling": False}
    base.update(kw)
    return EngineConfig(**base)


def _workload(num=30, rate=100.0, seed=0, **kw):
    return wl.make_workload("sharegpt", num, rate, max_model_len=128, seed=seed, **kw)


def _key(res):
    return [(r.request_id, r.status, r.first_token_s, r.finish_s, r.output_len, r.token_times,
             r.num_preemptions) for r in res.records]


def _sim(cfg, P=1, D=4, handover=HANDOVER, **kw):
    return Simulator(cfg, MODEL, num_replicas=D, prefill_replicas=P, handover=handover,
                     build_device=False, **kw)


def _all_blocks_back(sim):
    for rep in sim.replicas:
        st = rep.block_manager.stats()
        assert st["num_used_blocks"] == 0 and st["num_quarantined_blocks"] == 0, rep.name


def test_bad_settings_are_clear_errors():
    cfg = _config()
    with pytest.raises(ValueError, match="below num_replicas"):
        _sim(cfg, P=2, D=2)
    with pytest.raises(ValueError, match=">= 0"):
        _sim(cfg, P=-1, D=2)
    with pytest.raises(ValueError, match="prefill_replicas=0"):
        _sim(cfg, P=0, D=2)
    with pytest.raises(TypeError, match="needs handover"):
        _sim(cfg, P=1, D=2, handover=None)
    with pytest.raises(ValueError, match="bandwidth"):
        Link("x", 0.0, 0.0)
    with pytest.raises(ValueError, match="n > 1"):
        _sim(cfg).run(wl.make_workload("sharegpt", 4, 10.0, max_model_len=128, n=2, seed=0))


@pytest.mark.parametrize("P,D", [(1, 4), (2, 4), (1, 2)])  # D replicas in all
def test_roles_tokens_bytes_and_every_block_back(P, D):
    w = _workload()
    sim = _sim(_config(num_blocks=400), P=P, D=D)
    res = sim.run(w)
    colo = Simulator(_config(num_blocks=400), MODEL, num_replicas=D, build_device=False).run(w)
    assert res.summary["completed"] == colo.summary["completed"] == len(w)
    assert [r.output_len for r in res.records] == [s.output_len for s in w.requests]
    pre, dec = res.replicas[:P], res.replicas[P:]
    assert {r["role"] for r in pre} == {"prefill"} and {r["role"] for r in dec} == {"decode"}
    assert all(r["num_decode_tokens"] == 0 for r in pre)  # no preemption: no recompute
    assert all(r["num_prefill_tokens"] == 0 for r in dec)
    assert sum(r["num_prefill_tokens"] for r in pre) == sum(s.prompt_len for s in w.requests)
    assert sum(r["num_decode_tokens"] for r in dec) == \
        sum(r["num_decode_tokens"] for r in colo.replicas)
    spec = {s.request_id: s for s in w.requests}
    hs = res.handovers
    assert sorted(h["request_id"] for h in hs) == sorted(
        s.request_id for s in w.requests if s.output_len > 1)
    for h in hs:  # the seed's formula, and latency + bytes / bandwidth
        n = spec[h["request_id"]].prompt_len
        assert h["bytes"] == kv_bytes(32, n, 8, 128, 2) == 2 * 32 * n * 8 * 128 * 2
        assert math.isclose(h["transfer_s"], 10e-6 + h["bytes"] / 450e9, rel_tol=1e-9)
        assert h["start_s"] >= h["ready_s"]
        rec = next(r for r in res.records if r.request_id == h["request_id"])
        assert rec.first_token_s == h["ready_s"] and rec.token_times[1] > h["end_s"]
    sent = sum(r["kv_transfer_bytes"] for r in pre)
    assert sent == sum(r["kv_transfer_bytes"] for r in dec) == sum(h["bytes"] for h in hs) \
        == res.summary["kv_transfer_bytes"]
    _all_blocks_back(sim)


def test_a_full_decode_pool_makes_hand_overs_wait_without_deadlock():
    w = _workload(num=40, rate=400.0, seed=3)
    # 16 usable decode blocks of 8 tokens: a few sequences at a time.
    sim = _sim(_config(num_blocks=200), P=1, D=2, decode_config=_config(num_blocks=17))
    res = sim.run(w)
    assert res.summary["completed"] == 40
    waits = [h["wait_s"] for h in res.handovers]
    assert max(waits) > 0.01  # queued for decode room, holding prefill-side blocks
    starts = [h["start_s"] for h in res.handovers]
    assert starts == sorted(starts)  # FIFO: nothing overtakes
    _all_blocks_back(sim)


def test_aborts_before_during_and_after_a_hand_over_free_both_sides():
    w = _workload(num=20, rate=50.0, seed=5)
    cfg = _config(num_blocks=400)
    base = _sim(cfg, handover=SLOW).run(w)
    hs = {h["request_id"]: h for h in base.handovers}
    ids = list(hs)
    first = w.requests[0]
    aborts = {first.request_id: first.arrival_s + 1e-4,  # before its first token
              ids[2]: (hs[ids[2]]["start_s"] + hs[ids[2]]["end_s"]) / 2,  # mid-transfer
              ids[4]: hs[ids[4]]["end_s"] + 3e-3}  # on the decode side
    sim = _sim(cfg, handover=SLOW)
    res = sim.run(w, aborts=aborts)
    by_id = {r.request_id: r for r in res.records}
    for rid, t in aborts.items():
        assert by_id[rid].status == "aborted" and by_id[rid].finish_s == pytest.approx(t)
    assert res.summary["completed"] == 17
    _all_blocks_back(sim)
    sim = _sim(cfg, handover=SLOW)  # the time limit mid-transfer
    res = sim.run(w, max_time_s=(hs[ids[6]]["start_s"] + hs[ids[6]]["end_s"]) / 2)
    assert {r.status for r in res.records} <= {"finished", "aborted", "rejected"}
    assert next(r for r in res.records if r.request_id == ids[6]).status == "aborted"


def test_decode_fast_forward_gives_the_records_of_stepping():
    w = _workload(num=40, rate=60.0, seed=2, shared_prefix_len=16)
    out = []
    for ff in (False, True):
        sim = _sim(_config(num_blocks=40, enable_prefix_caching=True), P=1, D=3,
                   router=Router("prefix_aware"), fast_forward=ff)
        res = sim.run(w, aborts={w.requests[7].request_id: 0.3})
        out.append((res, sum(r.num_fast_steps for r in sim.replicas),
                    [r.block_manager.stats() for r in sim.replicas]))
    (a, ff_a, bm_a), (b, ff_b, bm_b) = out
    assert ff_a == 0 and ff_b > 0
    assert _key(a) == _key(b) and a.handovers == b.handovers and bm_a == bm_b


def test_quantized_kv_hands_over_its_scales_and_the_network_is_slower():
    int8 = LLAMA3_8B.with_kv_cache(EngineConfig(kv_cache_dtype="int8"))
    page = LLAMA3_8B.with_kv_cache(EngineConfig(kv_cache_dtype="int8",
                                                kv_scale_granularity="page"))
    n = 1000
    assert LinkTransport(NVLINK4_H200, int8).nbytes(n, 16) == 2 * 32 * n * 8 * 128 * 1 + 2 * 32 * 8 * 4 * n
    assert LinkTransport(NVLINK4_H200, page).nbytes(n, 16) == \
        2 * 32 * n * 8 * 128 + 2 * 32 * 8 * 4 * math.ceil(n / 16)
    b = HANDOVER.nbytes(n, 16)
    assert b == 131_072_000  # 128 KiB per token
    assert LinkTransport(IB_NDR_400, LLAMA3_8B).time(b) == 20e-6 + b / 50e9  # 2.64 ms
    assert HANDOVER.time(b) == 10e-6 + b / 450e9  # 0.30 ms


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_on_the_decode_side_recomputes_or_swaps_there(mode):
    w = _workload(num=30, rate=400.0, seed=7)
    sim = _sim(_config(num_blocks=200), P=1, D=2,
               decode_config=_config(num_blocks=20, preemption_mode=mode))
    res = sim.run(w)
    dec = res.replicas[1]
    assert res.summary["completed"] == 30 and dec["num_preemptions"] > 0
    assert sum(r.num_preemptions for r in res.records) == dec["num_preemptions"]
    if mode == "recompute":  # the preempted sequence's prompt is recomputed on the decode side
        assert dec["num_recompute_tokens"] > 0
    else:  # (recompute too once the host slots run out)
        assert dec["num_swap_outs"] > 0
    assert res.replicas[0]["num_decode_tokens"] == 0
    _all_blocks_back(sim)


def test_the_engine_setting_disaggregates_the_simulator_alike():
    """``EngineConfig(data_parallel_size=D, prefill_replicas=P)``, the engine's own setting, gives
    the simulator its P:D split (D replicas unless ``num_replicas`` says otherwise)."""
    w = _workload(num=12)
    explicit = _sim(_config(num_blocks=400), P=1, D=3).run(w)
    sim = Simulator(_config(num_blocks=400, data_parallel_size=3, prefill_replicas=1), MODEL,
                    handover=HANDOVER, build_device=False)
    res = sim.run(w)
    assert [r["role"] for r in res.replicas] == ["prefill", "decode", "decode"]
    assert _key(res) == _key(explicit) and res.handovers == explicit.handovers
    with pytest.raises(TypeError, match="needs handover"):
        Simulator(_config(data_parallel_size=3, prefill_replicas=1), MODEL)


def test_decode_fast_forward_prices_the_step_after_a_pause_as_stepping():
    # A decode replica that drained gets hand-overs: its first step (a stretch's first) runs
    # after a pause; a stretch cut before its end leaves the replica busy, so the next step is
    # not priced as one after a pause (fast-forward used to keep the pause until a finish).
    idle = LinearStepModel({**MODEL.coef, "after_idle": 3e-3})
    w = _workload(num=30, rate=20.0, seed=1)
    keys = []
    for ff in (False, True):
        sim = Simulator(_config(num_blocks=40), idle, num_replicas=3, prefill_replicas=1,
                        handover=HANDOVER, build_device=False, fast_forward=ff)
        keys.append(_key(sim.run(w)))
        assert ff == (sum(r.num_fast_steps for r in sim.replicas) > 0)
    assert keys[0] == keys[1]
