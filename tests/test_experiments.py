"""Every experiment's smoke config runs end to end and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(module: str, *flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_serve_smoke(tmp_path):
    out = tmp_path / "serve"
    proc = _run("experiments.serve", "--config=experiments/configs/serve.py:smoke",
                f"--config.output_dir={out}")
    assert "paged+continuous" in proc.stdout and "contiguous+static" in proc.stdout
    payload = json.loads((out / "summary.json").read_text())
    assert payload["evidence"] == "constructed"
    assert payload["provenance"]["jax_version"]
    for arm in payload["arms"]:
        assert arm["summary"]["completed"] == arm["summary"]["num_requests"] == 6
        assert len(arm["records"]) == 6
        assert arm["trace"]["time_s"], "KV usage trace is empty"
    assert (out / "latency_cdf.png").stat().st_size > 0 and (out / "kv_usage.png").stat().st_size > 0


def test_engine_bench_smoke(tmp_path):
    out = tmp_path / "eb.json"
    _run("experiments.engine_bench", "--config=experiments/configs/engine_bench.py:smoke",
         f"--config.output_json={out}")
    payload = json.loads(out.read_text())
    rows = payload["results"]
    assert [(r["mode"], r["num_running"]) for r in rows] == [("steady", 4), ("churn", 4)]
    assert all(r["median_host_ms"] > 0 and r["median_device_ms"] > 0 for r in rows)
    steady, churn = rows
    assert steady["batched_decode_steps"] == 2 * steady["steps"]  # timed and isolated blocks
    assert steady["decode_run_steps"] > 0  # the lockstep batch keeps its tokens in arrays
    assert churn["median_tokens_per_step"] > 4  # prefill chunks beside the decodes


def test_engine_bench_configs():
    import pytest

    from experiments.configs import engine_bench

    assert engine_bench.get_config("gpu").num_running == (256, 64)  # the target figure first
    assert engine_bench.get_config("default").num_running == (64, 256)
    with pytest.raises(ValueError, match="unknown variant"):
        engine_bench.get_config("tpu")


def test_device_check_script_parses():
    """experiments/device_check.sh (the one-shot GPU run) is at least valid bash; its CPU dry run
    is ``DEVICE_CHECK_SMOKE=1 OUT=/tmp/devout PYTHON=.venv/bin/python bash experiments/device_check.sh``."""
    proc = subprocess.run(["bash", "-n", "experiments/device_check.sh"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_serve_bad_config_fails_cleanly(tmp_path):
    bad = "--config.workload.rate=-1"
    proc = subprocess.run([sys.executable, "-m", "experiments.serve",
                           "--config=experiments/configs/serve.py:smoke", bad,
                           f"--config.output_dir={tmp_path}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr or "must be" in proc.stderr


def test_ablate_smoke(tmp_path):
    proc = _run("experiments.ablate", "--config=experiments/configs/ablate.py:smoke",
                f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "ablate.json").read_text())
    assert len(payload["arms"]) == 4  # kv_layout x scheduling in the smoke grid
    assert set(payload["main_effects"]) == {"kv_layout", "scheduling"}
    assert "main effects" in proc.stdout


def test_capacity_smoke(tmp_path):
    proc = _run("experiments.capacity", "--config=experiments/configs/capacity.py:smoke",
                f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "capacity.json").read_text())
    assert [a["name"] for a in payload["arms"]] == ["paged+continuous", "contiguous+static"]
    for arm in payload["arms"]:
        assert arm["capacity_rps"] == max(p["rate"] for p in arm["points"] if p["meets_slo"])
    assert "ratio" in proc.stdout and (tmp_path / "capacity.png").exists()
