"""Tests for the real traces in paged.workload.workload: the Azure loader, derivations, evidence checks."""

import csv
import datetime
import json

import numpy as np
import pytest

from paged.workload import workload as wl


def _columns(service):
    path = wl.AZURE_TRACE_DIR / wl.AZURE_TRACES[service]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    ctx = np.array([int(r["ContextTokens"]) for r in rows])
    gen = np.array([int(r["GeneratedTokens"]) for r in rows])
    stamps = [datetime.datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
    return ctx, gen, stamps


@pytest.fixture(scope="module")
def code():
    return wl.load_azure_trace("code")


@pytest.mark.parametrize("service,count", [("code", 8819), ("conv", 19366)])
def test_loader_counts_medians_and_times_match_the_csv(service, count):
    w = wl.load_azure_trace(service)
    ctx, gen, stamps = _columns(service)
    assert len(w) == count == len(ctx) == w.meta["row_count"]
    assert w.evidence == "real" and w.meta["derived"] == [] and w.meta["licence"] == "CC-BY-4.0"
    assert "Splitwise" in w.meta["attribution"]
    s = w.summary()
    assert s["p50_prompt_len"] == np.median(ctx) and s["p50_output_len"] == np.median(gen)
    assert [r.prompt_len for r in w.requests] == ctx.tolist()
    assert [r.output_len for r in w.requests] == gen.tolist()
    assert w.requests[0].arrival_s == 0.0
    span = (stamps[-1] - stamps[0]).total_seconds()  # microseconds; the file has 100 ns
    assert w.duration_s == pytest.approx(span, abs=1e-6)
    assert all(r.prompt_token_ids is None and r.prompt is None for r in w.requests)


def test_derivations_recorded_in_order_and_round_tripped(code, tmp_path):
    d = code.window(120, 420).time_scaled(0.25).subsample(0.5, seed=3).clip_lengths(2048)
    assert d.evidence == "real"
    assert [e["name"] for e in d.meta["derived"]] == ["window", "time_scale", "subsample",
                                                       "clip_lengths"]
    assert d.meta["derived"][0]["clock"] == "18:19:03-18:24:03"
    assert d.label() == ("evidence: real, derived: [window 18:19:03-18:24:03, time_scale 0.25, "
                         "subsample 0.5 seed 3, lengths clipped to 2048]")
    inside = [r for r in code.requests if 120 <= r.arrival_s < 420]
    assert len(d) == round(0.5 * len(inside)) and d.duration_s <= 300 * 0.25
    assert all(r.prompt_len + r.output_len <= 2048 for r in d.requests)
    path = tmp_path / "t.jsonl"
    d.to_jsonl(path)
    back = wl.Workload.from_jsonl(path)
    assert back == d and back.meta == d.meta and back.label() == d.label()


def test_time_scale_keeps_burstiness_and_window_shifts(code):
    gaps = np.diff(code.arrivals())
    fast = code.time_scaled(0.1)
    g2 = np.diff(fast.arrivals())
    assert np.allclose(g2, gaps * 0.1)
    assert g2.std() / g2.mean() == pytest.approx(gaps.std() / gaps.mean())
    win = code.window(600, 660)
    assert win.arrivals().min() >= 0 and win.arrivals().max() < 60
    assert {r.request_id for r in win.requests} == {
        r.request_id for r in code.requests if 600 <= r.arrival_s < 660}


def test_subsample_is_reproducible_and_seeded(code):
    a, b, c = code.subsample(0.1, 0), code.subsample(0.1, 0), code.subsample(0.1, 1)
    assert a == b and a != c and len(a) == round(0.1 * len(code))


def test_clip_and_scale_lengths_are_proportional():
    w = wl.Workload("t", (wl.RequestSpec("a", 0.0, None, None, 3000, 1000),
                          wl.RequestSpec("b", 1.0, None, None, 100, 50)), "real", None)
    c = w.clip_lengths(2000)
    assert (c.requests[0].prompt_len, c.requests[0].output_len) == (1500, 500)
    assert c.requests[1] == w.requests[1] and c.meta["derived"][0]["num_clipped"] == 1
    s = w.scale_lengths(0.1, 256)
    assert [(r.prompt_len, r.output_len) for r in s.requests] == [(192, 64), (10, 5)]
    assert [e["name"] for e in s.meta["derived"]] == ["scale_lengths", "clip_lengths"]


def test_synthetic_prompts_seeded_and_shared_system_prompt_is_labelled(code):
    w = code.window(0, 30)
    a, b = w.with_synthetic_prompts(5), w.with_synthetic_prompts(5)
    assert a == b and a.label() == w.label()
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in a.requests)
    s = w.with_synthetic_prompts(5, system_prompt_len=64)
    assert "shared system prompt 64 tokens (assumption)" in s.label()
    longs = [r for r in s.requests if r.prompt_len > 65]
    assert len({r.prompt_token_ids[:65] for r in longs}) == 1
    assert all(r.shared_prefix_len == 65 for r in longs)
    with pytest.raises(ValueError, match="must be compared|different derivations"):
        wl.check_same_evidence([a, s])


def test_mixing_is_refused_with_one_line(code):
    constructed = wl.make_workload("sharegpt", 5, 1.0, max_model_len=256, seed=0)
    with pytest.raises(ValueError, match="mix evidence labels") as e:
        wl.check_same_evidence([code, constructed])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="different derivations") as e:
        wl.check_same_evidence([code.window(0, 600), code.window(600, 1200)])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="different derivations"):
        wl.check_same_evidence([code, code.time_scaled(0.5)])
    w = code.window(0, 60)
    assert wl.check_same_evidence([w.time_scaled(0.5), w.time_scaled(0.2)],
                                  swept=("time_scale",)) == "real"
    assert wl.check_same_evidence([{"evidence": "real", "derived": w.meta["derived"]}, w]) == "real"


@pytest.mark.parametrize("call,match", [
    (lambda w: wl.load_azure_trace("chat"), "service='chat'"),
    (lambda w: w.time_scaled(0), "factor=0"),
    (lambda w: w.time_scaled(float("nan")), "factor"),
    (lambda w: w.window(50, 10), "end_s=10"),
    (lambda w: w.window(1e6, 2e6), "leaves no requests"),
    (lambda w: w.subsample(1.5, 0), "fraction=1.5"),
    (lambda w: w.subsample(0.5, -1), "seed=-1"),
    (lambda w: w.clip_lengths(1), "max_model_len=1"),
    (lambda w: w.with_synthetic_prompts(0, system_prompt_len=-2), "system_prompt_len=-2"),
])
def test_bad_arguments_name_the_value(code, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(code)


def test_malformed_csv_names_the_line(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.1,5,3\n"
                 "2023-11-16 18:00:01.2,x,3\n")
    with pytest.raises(ValueError, match=r"t.csv:3"):
        wl.load_azure_trace("code", path=p)
    p.write_text("time,in,out\n")
    with pytest.raises(ValueError, match="header"):
        wl.load_azure_trace("code", path=p)


def test_trace_stats_smoke_labels_and_compares(tmp_path):
    from experiments import trace_stats
    from experiments.configs import trace_stats as config

    c = config.get_config("smoke")
    c.output_dir = str(tmp_path)
    trace_stats.main(c, trace_stats.check(c))
    out = json.loads((tmp_path / "trace_stats.json").read_text())
    assert out["evidence"] == "real" and out["provenance"]["load_average"]
    code = out["traces"]["code"]
    assert code["label"].startswith("evidence: real, derived: [window 18:17:03-18:22:03")
    w = wl.load_azure_trace("code").window(0, 300)
    assert code["num_requests"] == len(w)
    assert code["p50_context_tokens"] == np.median([r.prompt_len for r in w.requests])
    assert sum(code["requests_per_bin"]) == len(w)
    assert {r["figure"] for r in code["paper"]} == {"p50_context_tokens", "p50_generated_tokens"}
    assert (tmp_path / "rate_per_minute.png").stat().st_size > 0
    assert (tmp_path / "lengths.png").stat().st_size > 0


def test_tensor_parallel_roofline():
    from paged.sim.roofline import RooflineStepModel, TensorParallelRooflineStepModel
    from paged.sim.specs import H200, LLAMA3_8B, LLAMA3_70B
    from paged.sim.step_model import StepShape

    s = StepShape(num_tokens=300, num_seqs=100, num_decode=100, kv_read=200_000,
                  attn_pairs=200_000, num_samples=100)
    one = TensorParallelRooflineStepModel(H200, LLAMA3_8B, tensor_parallel=1)
    assert one.time(s) == pytest.approx(RooflineStepModel(H200, LLAMA3_8B).time(s))
    t8 = TensorParallelRooflineStepModel(H200, LLAMA3_70B, tensor_parallel=8)
    no_link = TensorParallelRooflineStepModel(H200, LLAMA3_70B, tensor_parallel=8,
                                              allreduce_latency_s=0.0, link_bandwidth=1e30)
    ring = 2 * 7 / 8 * 300 * 8192 * 2 / 450e9  # 300 tokens of d_model bf16 over NVLink
    assert t8.time(s) - no_link.time(s) == pytest.approx(2 * 80 * (10e-6 + ring))
    assert t8.time(s) < RooflineStepModel(H200, LLAMA3_70B).time(s) / 4
    assert t8.decode_times(64, 64_000, 2, 64, 64)[0] == t8.time(StepShape(
        num_tokens=64, num_seqs=64, num_decode=64, kv_read=64_000, attn_pairs=64_000,
        num_samples=64, padded_tokens=64, padded_seqs=64))
    with pytest.raises(ValueError, match="tensor_parallel=3"):
        TensorParallelRooflineStepModel(H200, LLAMA3_70B, tensor_parallel=3)


def test_fleet_traces_smoke(tmp_path):
    from experiments import fleet
    from experiments.configs import fleet as fleet_config

    c = fleet_config.get_config("traces_smoke")
    c.trace_arms = (c.trace_arms[0], c.trace_arms[2])
    c.output_dir = str(tmp_path)
    fleet.main(c, fleet.check(c))
    out = json.loads((tmp_path / "fleet.json").read_text())
    assert out["evidence"] == "simulated" and set(out["traces"]) == {"code", "conv"}
    for service, t in out["traces"].items():
        assert t["label"].startswith("evidence: real, derived: [window")
        assert "subsample 0.1 seed 0, lengths clipped to 4096]" in t["label"]
        paged, static = t["arms"]
        assert paged["arm"] == "paged+prefix cache" and static["arm"] == "contiguous+static"
        for a in t["arms"]:
            for p in a["points"]:
                assert p["evidence"] == "simulated" and p["workload_evidence"] == "real"
                assert p["derived"][-1] == {"name": "time_scale", "factor": p["time_scale"]}
                s = p["summary"]
                assert s["num_aborted"] + s["num_timeout"] + s["num_rejected"] == len(p["failed"])
                assert s["completed"] + len(p["failed"]) == s["num_requests"] == t["summary"][
                    "num_requests"]
        assert paged["capacity_rps"] > static["capacity_rps"] > 0
        assert (tmp_path / f"goodput_{service}.png").stat().st_size > 0


@pytest.mark.parametrize("bad,match", [
    ({"trace_services": ("chat",)}, "trace_services"),
    ({"trace_setups": (("Llama-3-8B", 3),)}, "tensor_parallel=3"),
    ({"trace_setups": (("GPT-9", 1),)}, "GPT-9"),
    ({"trace_window": (10.0,)}, "trace_window"),
    ({"trace_window": (1e6, 2e6)}, "leaves no requests"),
    ({"trace_speedup_hi": 0.5}, "trace_speedup_hi"),
    ({"trace_arms": (("x", {"block_size": 0}),)}, "block_size"),
])
def test_fleet_traces_bad_settings(bad, match):
    from experiments import fleet
    from experiments.configs import fleet as fleet_config

    c = fleet_config.get_config("traces_smoke")
    for k, v in bad.items():
        setattr(c, k, v)
    with pytest.raises((ValueError, TypeError), match=match):
        fleet.check(c)


def test_capacity_on_a_real_window_scales_time_per_rate():
    from experiments import capacity
    from experiments.configs import capacity as config

    c = config.get_config("smoke")
    c.workload.azure, c.workload.window, c.rates = "conv", (1200.0, 1203.0), (2.0, 8.0)
    plan = capacity.check(c)
    low, high = plan["workloads"][2.0], plan["workloads"][8.0]
    assert low.evidence == high.evidence == "real" and len(low) == len(high)
    assert len(low) / low.duration_s == pytest.approx(2.0)
    assert len(high) / high.duration_s == pytest.approx(8.0)
    assert [e["name"] for e in high.meta["derived"]] == ["window", "scale_lengths",
                                                         "clip_lengths", "time_scale"]
    high.check_fits(c.engine.max_model_len)
    c.workload.time_scale = 0.5
    with pytest.raises(ValueError, match="workload.time_scale=0.5"):
        capacity.check(c)
