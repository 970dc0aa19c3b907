"""Tests for paged.workload.workload: arrivals, lengths, constructed workloads, trace files, evidence."""

import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest

from paged.workload import workload as wl

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "experiments/traces/tiny_constructed.jsonl"


# --- arrivals --------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [
    lambda seed: wl.poisson_arrivals(3.0, 50, seed=seed),
    lambda seed: wl.gamma_arrivals(3.0, 50, burstiness=0.5, seed=seed)])
def test_arrivals_seeded(fn):
    a = fn(0)
    assert np.array_equal(a, fn(0)) and not np.array_equal(a, fn(1))
    assert a[0] == 0 and np.all(np.diff(a) >= 0) and a.shape == (50,)


def test_poisson_mean_interarrival():
    gaps = np.diff(wl.poisson_arrivals(4.0, 20_001, seed=0))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)


def test_gamma_burstiness_one_is_poisson():
    g = wl.gamma_arrivals(2.0, 20_001, burstiness=1.0, seed=7)
    assert np.array_equal(g, wl.poisson_arrivals(2.0, 20_001, seed=7))
    gaps = np.diff(g)  # exponential: mean 1/rate, variance 1/rate**2, CV 1
    assert gaps.mean() == pytest.approx(0.5, rel=0.03)
    assert gaps.var() == pytest.approx(0.25, rel=0.06)


def test_gamma_burstier_has_higher_cv():
    def cv(k):
        gaps = np.diff(wl.gamma_arrivals(2.0, 20_001, burstiness=k, seed=3))
        assert gaps.mean() == pytest.approx(0.5, rel=0.05)  # the rate does not change
        return gaps.std() / gaps.mean()
    assert cv(0.25) == pytest.approx(2.0, rel=0.08) and cv(0.25) > 1.5 * cv(1.0)
    assert cv(4.0) == pytest.approx(0.5, rel=0.05)


def test_infinite_rate_is_all_at_once():
    assert np.array_equal(wl.poisson_arrivals(math.inf, 4, seed=0), np.zeros(4))


@pytest.mark.parametrize("kwargs,match", [
    ({"rate": 0.0}, "rate=0.0"), ({"rate": -1}, "rate=-1"), ({"rate": math.nan}, "rate=nan"),
    ({"num": 0}, "num=0"), ({"burstiness": 0.0}, "burstiness=0.0"),
    ({"burstiness": -2}, "burstiness=-2")])
def test_arrival_validation(kwargs, match):
    args = {"rate": 1.0, "num": 3, "burstiness": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        wl.gamma_arrivals(args["rate"], args["num"], burstiness=args["burstiness"], seed=0)


def test_fixed_arrivals():
    assert wl.fixed_arrivals([0, 0.5, 0.5, 2]).tolist() == [0, 0.5, 0.5, 2]
    with pytest.raises(ValueError, match=r"times\[2\]=0.1 < times\[1\]=0.5"):
        wl.fixed_arrivals([0, 0.5, 0.1])
    with pytest.raises(ValueError, match=r"times\[0\]=-1.0"):
        wl.fixed_arrivals([-1.0])
    with pytest.raises(ValueError, match="non-empty"):
        wl.fixed_arrivals([])


# --- lengths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [wl.sharegpt_like_lengths, wl.alpaca_like_lengths])
@pytest.mark.parametrize("max_model_len,reserved", [(64, 0), (256, 50), (2048, 0), (4096, 300)])
def test_lengths_fit(fn, max_model_len, reserved):
    p, o = fn(2000, max_model_len=max_model_len, seed=0, reserved=reserved)
    assert p.min() >= 1 and o.min() >= 1
    assert (reserved + p + o).max() <= max_model_len
    assert np.array_equal(p, fn(2000, max_model_len=max_model_len, seed=0, reserved=reserved)[0])


@pytest.mark.parametrize("profile,output_low", [(wl.ALPACA, 0.97), (wl.SHAREGPT, 0.93)])
@pytest.mark.parametrize("max_model_len", [512, 2048, 8192])
def test_lengths_keep_scaled_means(profile, output_low, max_model_len):
    # Clipping to the window trims the ShareGPT output tail (~1.6% of requests), lowering its mean.
    scale = max_model_len / 2048
    p, o = wl.profile_lengths(profile, 20_000, max_model_len=max_model_len, seed=1)
    assert p.mean() == pytest.approx(profile.mean_prompt * scale, rel=0.04)
    target = profile.mean_output * scale
    assert output_low * target <= o.mean() <= 1.02 * target


def test_lengths_validation():
    with pytest.raises(ValueError, match="max_model_len=1"):
        wl.sharegpt_like_lengths(4, max_model_len=1, seed=0)
    with pytest.raises(ValueError, match="max_model_len=100"):
        wl.sharegpt_like_lengths(4, max_model_len=100, seed=0, reserved=99)
    with pytest.raises(ValueError, match="num=0"):
        wl.alpaca_like_lengths(0, max_model_len=100, seed=0)


def test_synthetic_prompt():
    ids = wl.synthetic_prompt(100, rng=np.random.default_rng(0), vocab=256)
    assert len(ids) == 100 and all(0 <= t < 256 for t in ids)


# --- constructed workloads -------------------------------------------------------------------
def test_make_workload_sharegpt():
    w = wl.make_workload("sharegpt", 40, 5.0, max_model_len=512, seed=0, burstiness=0.5)
    assert w.evidence == "constructed" and w.seed == 0 and len(w) == 40
    w.check_fits(512)
    for r in w.requests:
        assert r.prompt_token_ids[0] == wl.BOS_ID and len(r.prompt_token_ids) == r.prompt_len
        assert r.shared_prefix_len == 1
    assert w.meta["lengths"]["scale"] == 0.25 and "linear" in w.meta["lengths"]["scale_rule"]
    assert w.meta["arrivals"] == {"process": "gamma", "rate": 5.0, "burstiness": 0.5}
    assert w == wl.make_workload("sharegpt", 40, 5.0, max_model_len=512, seed=0, burstiness=0.5)


def test_rate_changes_only_arrivals():
    a = wl.make_workload("alpaca", 20, 1.0, max_model_len=256, seed=3)
    b = wl.make_workload("alpaca", 20, 50.0, max_model_len=256, seed=3)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.output_len for r in a.requests] == [r.output_len for r in b.requests]
    assert a.duration_s > b.duration_s


def test_shared_prefix_and_parallel_sampling():
    w = wl.make_workload("sharegpt", 10, 2.0, max_model_len=512, seed=1, shared_prefix_len=40,
                         num_shots=2, shot_len=30, n=4)
    shared = w.requests[0].prompt_token_ids[:101]
    for r in w.requests:
        assert r.shared_prefix_len == 101 and r.prompt_token_ids[:101] == shared
        assert r.prompt_len >= 101 and r.prompt_len + r.output_len <= 512 and r.n == 4
    assert w.summary()["num_sequences"] == 40


def test_fixed_kind_and_fixed_arrivals():
    w = wl.make_workload("fixed", 3, None, max_model_len=64, seed=0, arrival_times=[0, 1, 1.5],
                         prompt_len=10, output_len=20, shared_prefix_len=5)
    assert [r.arrival_s for r in w.requests] == [0, 1, 1.5]
    assert {(r.prompt_len, r.output_len) for r in w.requests} == {(15, 20)}


@pytest.mark.parametrize("kwargs,match", [
    ({"kind": "lmsys"}, "kind='lmsys'"), ({"rate": 0}, "rate=0"), ({"rate": -3.0}, "rate=-3.0"),
    ({"num_requests": 0}, "num_requests=0"), ({"burstiness": 0}, "burstiness=0"),
    ({"shared_prefix_len": 63}, "max_model_len=64"), ({"n": 0}, "n=0"),
    ({"kind": "fixed", "prompt_len": 40, "output_len": 30}, "max_model_len=64"),
    ({"prompt_len": 4}, "kind='fixed'"), ({"arrival_times": [0, 1]}, "rate or arrival_times"),
])
def test_make_workload_validation(kwargs, match):
    args = {"kind": "alpaca", "num_requests": 4, "rate": 1.0, "max_model_len": 64, "seed": 0,
            **kwargs}
    with pytest.raises(ValueError, match=match):
        wl.make_workload(args.pop("kind"), args.pop("num_requests"), args.pop("rate"), **args)


def test_summary():
    s = wl.make_workload("alpaca", 200, 10.0, max_model_len=1024, seed=0).summary()
    assert s["evidence"] == "constructed" and s["num_requests"] == 200
    assert s["arrival_rate"] == pytest.approx(10.0, rel=0.25)
    assert s["p99_prompt_len"] <= s["max_prompt_len"] and s["max_total_len"] <= 1024
    json.dumps(s)


# --- trace files -----------------------------------------------------------------------------
def test_jsonl_round_trip(tmp_path):
    w = wl.make_workload("sharegpt", 12, 3.0, max_model_len=256, seed=5, shared_prefix_len=16)
    w.to_jsonl(tmp_path / "w.jsonl")
    back = wl.Workload.from_jsonl(tmp_path / "w.jsonl")
    assert back == w and back.evidence == "constructed"
    with pytest.raises(ValueError, match="evidence='real' but"):
        wl.Workload.from_jsonl(tmp_path / "w.jsonl", evidence="real")


def test_sample_trace_file():
    w = wl.Workload.from_jsonl(SAMPLE)
    assert w.evidence == "constructed" and len(w) == 4
    chat0, chat1, ids2, last = w.requests
    assert chat0.prompt_len == len("Hello, who are you?") + 1
    assert chat0.engine_prompt() == chat0.prompt
    assert chat1.n == 2 and ids2.engine_prompt() == [256, 72, 105] and last.request_id == "line5"
    with pytest.raises(ValueError, match="with_synthetic_prompts"):
        chat1.engine_prompt()
    filled = w.with_synthetic_prompts(0)
    assert len(filled.requests[1].engine_prompt()) == 40 and filled.evidence == "constructed"
    assert filled.requests[0] == chat0


def test_headerless_trace_needs_a_label(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_len": 5, "output_len": 3}\n\n'
                    '{"arrival_s": 2.5, "prompt": "hi", "output_len": 1}\n')
    with pytest.raises(ValueError, match="does not say what it is"):
        wl.Workload.from_jsonl(path)  # never "real" by default
    w = wl.Workload.from_jsonl(path, evidence="real")
    assert w.evidence == "real" and w.seed is None and w.meta["source"] == str(path)
    assert [r.prompt_len for r in w.requests] == [5, 3] and w.duration_s == 2.5
    assert wl.Workload.from_jsonl(path, evidence="constructed").evidence == "constructed"
    assert wl.Workload.from_jsonl(path, evidence="simulated").evidence == "simulated"
    with pytest.raises(ValueError, match="evidence='measured'"):
        wl.Workload.from_jsonl(path, evidence="measured")


@pytest.mark.parametrize("bad,match", [
    ("{not json", "not JSON"), ("[1, 2]", "expected a JSON object"),
    ('{"arrival_s": 1, "prompt_len": 5}', "missing 'output_len'"),
    ('{"arrival_s": 1, "output_len": 5}', "need one of"),
    ('{"arrival_s": -1, "prompt_len": 5, "output_len": 2}', "arrival_s=-1"),
    ('{"arrival_s": 1, "prompt_len": 0, "output_len": 2}', "prompt_len=0"),
    ('{"arrival_s": 1, "prompt_len": 5, "output_len": 2.5}', "output_len=2.5"),
    ('{"arrival_s": 1, "prompt": "abc", "prompt_len": 9, "output_len": 2}', "prompt_len=9"),
    ('{"arrival_s": 1, "prompt": 7, "output_len": 2}', "prompt=7"),
    ('{"arrival_s": 1, "prompt_len": 5, "ouput_len": 2, "output_len": 2}', "unknown keys"),
    ('{"arrival_s": 0.5, "prompt_len": 5, "output_len": 2}', "before the previous"),
    ('{"request_id": "a", "arrival_s": 1, "prompt_len": 5, "output_len": 2}', "duplicate"),
])
def test_bad_line_names_line_number(tmp_path, bad, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"request_id": "a", "arrival_s": 1, "prompt_len": 5, "output_len": 2}\n'
                    f"{bad}\n")
    with pytest.raises(ValueError, match=match) as e:
        wl.Workload.from_jsonl(path, evidence="constructed")
    if "duplicate" not in match and "previous" not in match:
        assert f"{path}:2:" in str(e.value)


def test_bad_header(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text('{"workload": {"evidence": "synthetic"}}\n'
                    '{"arrival_s": 0, "prompt_len": 5, "output_len": 3}\n')
    with pytest.raises(ValueError, match=r"h.jsonl:1: evidence='synthetic'"):
        wl.Workload.from_jsonl(path)


# --- evidence --------------------------------------------------------------------------------
def test_check_same_evidence():
    c = wl.make_workload("alpaca", 3, 1.0, max_model_len=128, seed=0)
    r = dataclasses.replace(c, evidence="real", name="trace")
    assert wl.check_same_evidence([c, c]) == "constructed"
    assert wl.check_same_evidence([{"evidence": "real"}, r]) == "real"
    with pytest.raises(ValueError, match="must not mix"):
        wl.check_same_evidence([c, r])
    with pytest.raises(ValueError, match="evidence=None"):
        wl.check_same_evidence([{"name": "x"}])
    with pytest.raises(ValueError, match="no workloads"):
        wl.check_same_evidence([])
    with pytest.raises(ValueError, match="evidence='both'"):
        dataclasses.replace(c, evidence="both")
