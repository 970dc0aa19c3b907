"""Every experiment's smoke config runs end to end and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert [r["num_running"] for r in rows] == [4, 8]
    assert all(r["median_host_ms"] > 0 and r["median_device_ms"] > 0 for r in rows)


@pytest.mark.parametrize("bad", ["--config.workload.rate=-1", "--config.engine.block_size=0"])
def test_serve_bad_config_fails_cleanly(bad, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.serve",
                           "--config=experiments/configs/serve.py:smoke", bad,
                           f"--config.output_dir={tmp_path}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr or "must be" in proc.stderr
