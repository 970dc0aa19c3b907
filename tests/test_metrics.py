"""Tests for paged.workload.metrics: hand-computed latencies, failures, goodput, traces."""

import json

import numpy as np
import pytest

from paged.workload.metrics import RequestRecord, Trace, meets_slo, stats_ms, summarize


def _rec(rid, status, arrival, sched, first, finish, times, prompt_len, output_len, **kw):
    return RequestRecord(rid, status, arrival, sched, first, finish, tuple(times), prompt_len,
                         output_len, **kw)


# Three finished requests with chosen timestamps (seconds):
#   r1: TTFT 0.5, E2E 1.0, TPOT (1.0-0.5)/2 = 0.25, ITL 0.2, 0.3, queue 0.1
#   r2: one output token: TTFT 0.2, E2E 0.2, TPOT undefined, queue 0
#   r3: TTFT 1.0, E2E 1.6, TPOT 0.6/3 = 0.2, ITL 0.1, 0.1, 0.4, queue 0.5
FINISHED = [
    _rec("r1", "finished", 0.0, 0.1, 0.5, 1.0, [0.5, 0.7, 1.0], 10, 3, num_preemptions=1,
         num_cached_tokens=4),
    _rec("r2", "finished", 1.0, 1.0, 1.2, 1.2, [1.2], 20, 1),
    _rec("r3", "finished", 2.0, 2.5, 3.0, 3.6, [3.0, 3.1, 3.2, 3.6], 30, 4, num_cached_tokens=8),
]
FAILED = [
    _rec("a", "aborted", 0.5, 0.6, 0.9, 1.5, [0.9], 7, 1, num_preemptions=2),
    _rec("t", "timeout", 1.0, 1.1, None, 3.0, [], 8, 0),
    _rec("x", "rejected", 3.0, None, None, None, [], 9, 0),
]


def test_per_request_values_hand_computed():
    r1, r2, r3 = FINISHED
    assert r1.ttft_s == pytest.approx(0.5) and r1.e2el_s == pytest.approx(1.0)
    assert r1.tpot_s == pytest.approx(0.25) and r1.queue_s == pytest.approx(0.1)
    assert r1.itl_s == pytest.approx((0.2, 0.3))
    assert r2.tpot_s is None and r2.itl_s == ()
    assert r3.tpot_s == pytest.approx(0.2) and r3.itl_s == pytest.approx((0.1, 0.1, 0.4))


def test_summarize_hand_computed():
    s = summarize(FINISHED, duration_s=4.0)
    assert s["completed"] == 3 and s["num_requests"] == 3
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx(17.0)
    assert s["mean_ttft_ms"] == pytest.approx(1700 / 3)
    assert s["median_ttft_ms"] == pytest.approx(500)
    assert s["mean_tpot_ms"] == pytest.approx(225) and s["num_tpot_undefined"] == 1
    assert s["mean_itl_ms"] == pytest.approx(220) and s["median_itl_ms"] == pytest.approx(200)
    assert s["mean_e2el_ms"] == pytest.approx(2800 / 3)
    assert s["mean_queue_ms"] == pytest.approx(200)
    assert s["num_preemptions"] == 1 and s["total_cached_tokens"] == 12
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.2)
    assert s["request_goodput"] is None
    json.dumps(s)


@pytest.mark.parametrize("metric,values", [
    ("ttft", [0.5, 0.2, 1.0]), ("tpot", [0.25, 0.2]), ("itl", [0.2, 0.3, 0.1, 0.1, 0.4]),
    ("e2el", [1.0, 0.2, 1.6]), ("queue", [0.1, 0.0, 0.5])])
def test_percentiles_match_numpy(metric, values):
    s = summarize(FINISHED + FAILED, duration_s=4.0)
    x = np.array(values) * 1000
    assert s[f"median_{metric}_ms"] == pytest.approx(np.median(x))
    assert s[f"p90_{metric}_ms"] == pytest.approx(np.percentile(x, 90))
    assert s[f"p99_{metric}_ms"] == pytest.approx(np.percentile(x, 99))
    assert s[f"std_{metric}_ms"] == pytest.approx(np.std(x))


def test_failures_counted_listed_and_excluded():
    only = summarize(FINISHED, duration_s=4.0)
    s = summarize(FINISHED + FAILED, duration_s=4.0)
    assert (s["num_aborted"], s["num_timeout"], s["num_rejected"]) == (1, 1, 1)
    assert s["failed_request_ids"] == ["a", "t", "x"]
    assert s["num_requests"] == 6 and s["completed"] == 3
    assert s["latency_population"] == "finished requests only (3 of 6)"
    assert "(2 of 3)" in s["tpot_population"] and "(5 gaps)" in s["itl_population"]
    for key in ("mean_ttft_ms", "p99_e2el_ms", "mean_itl_ms", "total_output_tokens"):
        assert s[key] == only[key]
    assert s["num_preemptions"] == 3  # preemptions of failed requests still count


def test_goodput_with_slo():
    # r1 misses TPOT (250 > 240), r2 passes (TPOT undefined), r3 misses TTFT (1000 > 600);
    # the aborted request would pass both but is not finished.
    s = summarize(FINISHED + FAILED, duration_s=4.0, ttft_slo_ms=600, tpot_slo_ms=240)
    assert s["num_good"] == 1 and s["request_goodput"] == pytest.approx(0.25)
    assert summarize(FINISHED, duration_s=2.0, ttft_slo_ms=600)["num_good"] == 2
    assert not meets_slo(FAILED[0], ttft_slo_ms=600, tpot_slo_ms=None)


def test_empty_population_is_none_not_zero():
    s = summarize(FAILED, duration_s=1.0, ttft_slo_ms=100)
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None and s["p99_itl_ms"] is None
    assert s["request_goodput"] == 0 and s["prefix_cache_hit_rate"] is None
    assert stats_ms("x", []) == {f"{k}_x_ms": None for k in ("mean", "median", "std", "p90", "p99")}


@pytest.mark.parametrize("kwargs,match", [
    ({"duration_s": 0}, "duration_s=0"), ({"duration_s": 1, "ttft_slo_ms": -1}, "ttft_slo_ms=-1"),
    ({"duration_s": 1, "evidence": "mixed"}, "evidence='mixed'")])
def test_summarize_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        summarize(FINISHED, **kwargs)


def test_summarize_rejects_duplicate_ids():
    with pytest.raises(ValueError, match="duplicate request_id='r1'"):
        summarize(FINISHED + FINISHED[:1], duration_s=1.0)


@pytest.mark.parametrize("args,match", [
    (("r", "done", 0.0, 0.0, 0.1, 0.2, [0.1], 1, 1), "status='done'"),
    (("r", "finished", 1.0, 0.5, 1.1, 1.2, [1.1], 1, 1), "first_scheduled_s=0.5 < arrival_s=1.0"),
    (("r", "finished", 0.0, 0.0, None, 0.2, [], 1, 1), "needs first_token_s"),
    (("r", "finished", 0.0, 0.0, 0.1, 0.2, [0.1], 1, 2), "1 token_times for output_len=2"),
    (("r", "finished", 0.0, 0.0, 0.1, 0.2, [0.15], 1, 1), "does not start at first_token_s"),
    (("r", "finished", 0.0, 0.0, 0.1, 0.3, [0.1, 0.3, 0.2], 1, 3), "not non-decreasing"),
    (("r", "finished", 0.0, 0.0, 0.1, 0.2, [0.1], -1, 1), "prompt_len=-1"),
])
def test_record_validation(args, match):
    with pytest.raises(ValueError, match=match):
        _rec(*args)


def test_trace_columns_and_checks():
    tr = Trace()
    tr.record(0.0, num_running=1, num_waiting=2, batch_tokens=16, ledger={"effective_kv": 10,
                                                                          "free": 90})
    tr.record(0.5, num_running=2, num_waiting=0, num_swapped=1, batch_tokens=2,
              ledger={"free": 70, "effective_kv": 30})
    d = tr.to_dict()
    assert d["time_s"] == [0.0, 0.5] and d["num_swapped"] == [0, 1]
    assert d["ledger"] == {"effective_kv": [10, 30], "free": [90, 70]}
    json.dumps(d)
    with pytest.raises(ValueError, match="time_s=0.1 < previous 0.5"):
        tr.record(0.1, num_running=0, num_waiting=0, batch_tokens=0, ledger={"free": 1,
                                                                             "effective_kv": 0})
    with pytest.raises(ValueError, match="categories"):
        tr.record(1.0, num_running=0, num_waiting=0, batch_tokens=0, ledger={"free": 100})
    with pytest.raises(ValueError, match="num_waiting=-1"):
        tr.record(1.0, num_running=0, num_waiting=-1, batch_tokens=0)
    assert len(tr) == 2
    assert Trace().to_dict()["ledger"] == {}
