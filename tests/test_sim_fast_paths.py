"""The simulator's fast paths give what the plain forms give: the roofline's decode times, the
pseudo-token mixes, the router fed kept loads, summarize's pooled token gaps, a decode run on a
quiet pool, and a record's token-time order check."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from paged.fleet.routing import Router
from paged.kv.block_manager import BlockManager
from paged.kv.blocks import decode_run
from paged.sim import H200, LLAMA3_8B, QWEN25_7B, RooflineStepModel, StepTimeModel
from paged.sim.batches import pseudo_token, pseudo_token_steps, pseudo_tokens
from paged.workload import metrics


@pytest.mark.parametrize("dtype, granularity", [("auto", "token"), ("int8", "token"),
                                                ("fp8_e4m3", "page")])
def test_roofline_decode_times_equal_the_per_step_times(dtype, granularity):
    rng = random.Random(0)
    for dims in (LLAMA3_8B, QWEN25_7B):
        dims = dataclasses.replace(dims, kv_cache_dtype=dtype, kv_scale_granularity=granularity)
        for bs in (8, 16):
            rm = RooflineStepModel(H200, dims, block_size=bs)
            for _ in range(30):
                n, k = rng.randint(1, 256), rng.randint(1, 128)
                kv0 = rng.randint(n, 400_000)
                assert rm.decode_times(n, kv0, k, 8, 8) == \
                    StepTimeModel.decode_times(rm, n, kv0, k, 8, 8)


def test_pseudo_token_forms_agree():
    rng = random.Random(1)
    for _ in range(2000):
        s, j, p = rng.randrange(2**31), rng.randrange(64), rng.randrange(2**31)
        salt = rng.choice([0, 7, rng.randrange(-2**40, 2**40)])
        assert pseudo_token(s, j, p, salt) == int(pseudo_tokens([s], [j], [p], salt)[0])
    seeds = np.array([rng.randrange(2**31) for _ in range(9)], np.int32)
    index = np.arange(9, dtype=np.int32)
    pos = np.array([rng.randrange(2**30) for _ in range(9)], np.int32)
    grid = pseudo_tokens(seeds[:, None], index[:, None], pos[:, None].astype(np.int64)
                         + np.arange(40), 3)
    assert (pseudo_token_steps(seeds, index, pos, 40, 3) == grid).all()


class _Rep:
    def __init__(self, load):
        self.num_waiting, self.num_running = 0, load

    def cached_prefix_tokens(self, token_ids, cache_salt=None, probe=None):
        return 0


@pytest.mark.parametrize("policy", ["least_loaded", "prefix_aware"])
def test_router_with_kept_loads_routes_as_reading_them(policy):
    rng = random.Random(2)
    a, b = Router(policy), Router(policy)
    for _ in range(300):
        reps = [_Rep(rng.randrange(4)) for _ in range(rng.choice([2, 5, 8]))]
        loads = [r.num_waiting + r.num_running for r in reps]
        assert a.route([1], reps) == b.route([1], reps, loads=loads)
    assert a.num_routed == b.num_routed
    with pytest.raises(ValueError, match="2 loads for 3 replicas"):
        b.route([1], [_Rep(0)] * 3, loads=[0, 0])


def test_summarize_pools_the_gaps_of_itl_s():
    rng = random.Random(3)
    recs = []
    for i in range(40):
        status = rng.choice(["finished", "finished", "aborted", "rejected"])
        n = 0 if status == "rejected" else rng.randint(1 if status == "finished" else 0, 30)
        times = list(itertools.accumulate(rng.random() * 0.01 for _ in range(n)))
        times = [t + 1.0 for t in times]
        recs.append(metrics.RequestRecord(
            f"r{i}", status, 0.0, 0.5 if n or status == "finished" else None,
            times[0] if times else None, (times[-1] if times else 1.0) if status != "rejected"
            else None, tuple(times), 3, n))
    s = metrics.summarize(recs, duration_s=2.0)
    pooled = [g for r in recs if r.status == "finished" for g in r.itl_s]
    assert s["itls"] == [list(r.itl_s) for r in recs]
    assert s["itl_population"] == f"token gaps of finished requests ({len(pooled)} gaps)"
    assert {k: v for k, v in s.items() if "_itl_" in k} == metrics.stats_ms("itl", pooled)


def test_record_token_time_order_check():
    nan = float("nan")
    ok = metrics.RequestRecord("a", "aborted", 0.0, 0.1, 0.2, 0.9, (0.2, nan, 0.5), 1, 3)
    assert ok.token_times[0] == 0.2  # a NaN compares false both ways: not an inversion
    with pytest.raises(ValueError, match="not non-decreasing"):
        metrics.RequestRecord("b", "aborted", 0.0, 0.1, 0.2, 0.9, (0.2, 0.4, 0.3), 1, 3)
    assert metrics.RequestRecord("c", "aborted", 0.0, 0.1, 0.2, 0.9, [1, 2, 2], 1, 3) \
        .token_times == (1.0, 2.0, 2.0)


def test_a_quiet_decode_run_takes_the_one_take_path(monkeypatch):
    # Nothing quarantined, no copy pending, enough free blocks: the one-take path runs, and
    # leaves what the steps one at a time leave (tests/test_decode_run.py compares the rest).
    calls = []
    monkeypatch.setattr(decode_run, "_run_quiet", lambda *a: calls.append(a) or
                        _QUIET(*a))

    def build():
        bm = BlockManager(64, 4, cache_salt="m")
        for sid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [1, 2, 3, 4, 9, 9]), ("c", [7])):
            bm.allocate(sid, prompt)
            bm.step_completed(bm.begin_step())
            bm.mark_computed(sid, len(prompt))
        return bm

    rows = [[5, 6, 7, 8, 9, 1, 2, 3, 4], [5, 6, 7, 8, 9, 1, 2, 3, 4], [3] * 9]
    a, b = build(), build()
    assert a.run_decode_steps(["a", "b", "c"], rows)
    assert len(calls) == 1
    for j in range(9):
        assert b.append_decode_slots(["a", "b", "c"], [r[j] for r in rows]) == []
        b.step_completed(b.begin_step())
        full = [s for s in ("a", "b", "c") if b.num_tokens(s) % 4 == 0]
        if full:
            b.mark_computed_many(full, [b.num_tokens(s) for s in full])
    for sid in ("a", "b", "c"):
        assert a.block_table(sid) == b.block_table(sid)
        assert [a.block_key(x) is not None for x in a.block_table(sid)] == \
            [b.block_key(x) is not None for x in b.block_table(sid)]
    assert a.stats() == b.stats()
    assert (a.last_begun_step, a.last_completed_step) == (b.last_begun_step, b.last_completed_step)


_QUIET = decode_run._run_quiet


def test_record_as_dict_is_the_dataclass_dict():
    r = metrics.RequestRecord("a", "finished", 0.0, 0.1, 0.2, 0.5, (0.2, 0.5), 4, 2, 1, 16)
    want = dataclasses.asdict(r)
    want["token_times"] = [0.2, 0.5]
    assert r.as_dict() == want and list(r.as_dict()) == list(want)
