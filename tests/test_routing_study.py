"""The routing study (`experiments/routing.py`) end to end on its smoke config, on four forced
host devices (``XLA_FLAGS`` set for the subprocess before JAX starts), and its workload builder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_utils import host_devices_flags

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("routing")
    env = dict(os.environ, XLA_FLAGS=host_devices_flags(4),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.routing",
         "--config=experiments/configs/routing.py:smoke", f"--config.output_dir={out}"],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, json.loads((out / "routing.json").read_text()), out


def test_every_run_replays(study):
    """Each run (policies on one reused engine, scaling runs) left a cold-start record; a run on
    the engine after another (the second policy) re-executes exactly, routing included."""
    from experiments import replay as rp

    proc, res, out = study
    records = rp.load_records(str(out))
    labels = [p["label"] for p in res["policies"]] + [r["label"] for r in res["scaling"]["runs"]]
    assert [r["arm"] for r in records] == labels
    assert all(r["fresh_engine"] for r in records)
    assert f"replay: {rp.replay_command(out, devices=4)}" in proc.stdout
    arm = labels[1]
    env = dict(os.environ, XLA_FLAGS=host_devices_flags(4), JAX_PLATFORMS="cpu")
    replayed = subprocess.run([sys.executable, "-m", "experiments.replay", f"--from={out}",
                               f"--arm={arm}"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
    how = f"reproduce: {rp.replay_command(out, arm, devices=4)}"
    assert replayed.returncode == 0, replayed.stdout[-2000:] + replayed.stderr[-2000:] + how
    assert f"[{arm}] identical" in replayed.stdout


def test_policies(study):
    proc, res, out = study
    assert res["study"] == "routing" and res["evidence"] == "constructed"
    assert (out / "routing.png").stat().st_size > 0
    pols = {p["policy"]: p for p in res["policies"]}
    assert set(pols) == {"prefix_aware", "round_robin", "least_loaded"}
    for p in pols.values():
        s = p["summary"]
        assert p["data_parallel_size"] == 4 and len(p["per_replica"]) == 4
        assert s["completed"] == s["num_requests"] == 16, s
        assert p["num_compilations_during_run"] == 0, p  # warmed up: no request compiles
        served = [r["requests"] for r in p["per_replica"]]
        assert sum(served) == 16
        assert served == [r["num_requests_served"] for r in p["per_replica"]]
        # The requests' own cache counts agree with the replicas' block managers.
        assert [r["cached_tokens"] for r in p["per_replica"]] == [
            r["prefix_cache_hit_tokens"] for r in p["per_replica"]]
        for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                    "output_throughput", "request_throughput", "prefix_cache_hit_rate"):
            assert s[key] is not None and s[key] >= 0, (key, s[key])
        ev = p["evenness"]["requests"]
        assert ev["max_over_mean"] >= 1 and ev["cv"] >= 0
    assert sum(pols["prefix_aware"]["routed"].values()) == 16
    assert pols["round_robin"]["evenness"]["requests"]["cv"] == 0  # 16 requests, 4 replicas
    h = res["headline"]
    assert h["hit_rate_prefix_aware"] >= h["hit_rate_round_robin"] > 0, h
    assert h["hit_rate_ratio_pa_over_rr"] >= 1 and h["p99_ttft_ratio_pa_over_rr"] > 0, h
    by = res["by_policy"]
    assert set(by) == set(pols) and all(b["repeats"] == 1 for b in by.values())
    assert by["prefix_aware"]["prefix_cache_hit_rate"] == h["hit_rate_prefix_aware"]
    assert "prefix_aware vs round_robin" in proc.stdout and "requests CV" in proc.stdout


def test_scaling_host_bench_and_provenance(study):
    proc, res, _ = study
    sc = res["scaling"]["by_replicas"]
    assert [r["data_parallel_size"] for r in sc] == [1, 2, 4]
    assert sc[0]["speedup_vs_1"] == 1.0 and all(r["speedup_vs_1"] > 0 for r in sc)
    assert all(r["completed"] == 8 and r["cores_busy"] > 0 and r["ms_per_step"] > 0 for r in sc)
    runs = res["scaling"]["runs"]
    assert len(runs) == 3 and all(r["num_compilations_during_run"] == 0 for r in runs)
    hb = res["host_bench"]
    for mode in ("real", "isolated"):
        for d in ("1", "4"):
            x = hb[mode][d]
            assert x["steps"] == 2 * 4 and 0 < x["median_host_ms"] <= x["median_step_ms"], x
            assert len(x["round_median_host_ms"]) == 2
        assert hb[mode]["host_ratio"] > 0 and len(hb[mode]["host_ratio_rounds"]) == 2
    assert hb["meets_goal"] == (hb["host_ratio"] <= 2.0)
    m = res["machine"]
    assert m["cpu_count"] >= 1 and len(m["devices"]) == 4 and "same" in m["device_note"]
    prov = res["provenance"]
    assert prov["jax_version"] and prov["git_revision"] and len(prov["devices"]) == 4
    assert "host time ratio D=4/D=1" in proc.stdout


def test_tenant_workload():
    import ml_collections
    import numpy as np

    from experiments.configs.routing import get_config
    from experiments.routing import tenant_workload
    from paged.workload.workload import BOS_ID, make_workload

    w = get_config("smoke").workload
    wl = tenant_workload(w, 40, 5.0, seed=3)
    base = make_workload("fixed", 40, 5.0, max_model_len=128, seed=3, shared_prefix_len=40,
                         prompt_len=3, output_len=4)
    assert np.array_equal(wl.arrivals(), base.arrivals())  # Poisson arrivals of make_workload
    assert wl.evidence == "constructed"
    prefixes = {}
    for r in wl.requests:
        ids = r.prompt_token_ids
        assert ids[0] == BOS_ID and r.prompt_len == len(ids) == r.shared_prefix_len + 2
        assert r.shared_prefix_len - 1 in (16, 24, 40)
        prefixes.setdefault(r.request_id.split("-")[0], set()).add(ids[:r.shared_prefix_len])
    assert all(len(p) == 1 for p in prefixes.values())  # one system prompt per tenant
    assert len({next(iter(p)) for p in prefixes.values()}) == len(prefixes) == 3
    assert sum(wl.meta["tenants"]["requests_per_tenant"]) == 40
    skewed = ml_collections.ConfigDict(w.to_dict())
    skewed.tenant_zipf = 3.0
    counts = tenant_workload(skewed, 200, 5.0, seed=3).meta["tenants"]["requests_per_tenant"]
    assert counts[0] > counts[1] > counts[2], counts


def test_merged_kv_stats_skip_a_replicas_none():
    from paged.engine.data_parallel import _merge

    merged = _merge([{"a": 1.5, "b": {"c": None, "n": 2}, "block_size": 8},
                     {"a": None, "b": {"c": 2.0, "n": 3}, "block_size": 8}])
    assert merged == {"a": 1.5, "b": {"c": 2.0, "n": 5}, "block_size": 8}
