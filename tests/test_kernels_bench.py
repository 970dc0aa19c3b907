"""The kernel benchmark's smoke config, end to end (every implementation on tiny shapes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_config_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "experiments.kernel_bench",
        "--config=experiments/configs/kernel_bench.py:smoke", f"--out={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    for key in ("jax_version", "devices", "git_revision", "config", "peak_gbps"):
        assert key in record
    for op in ("decode", "ragged"):
        impls = record[op]["impls"]
        assert set(impls) == set(record["config"][f"{op}_impls"])
        for name, r in impls.items():
            assert r["correct"], (op, name, r)
            assert r["median_ms"] > 0
            assert r["achieved_gbps"] > 0 and r["ratio_to_dense"] > 0
        assert record[op]["bytes"] > 0


def test_configs_load_and_reject_unknown_variants():
    from experiments.configs import kernel_bench

    for name in ("cpu", "smoke", "h200"):
        cfg = kernel_bench.get_config(name)
        assert cfg.name == name and cfg.decode_impls
    with pytest.raises(ValueError, match="unknown variant 'x'"):
        kernel_bench.get_config("x")
