"""Times paged decode and ragged attention per implementation against dense contiguous attention.

    .venv/bin/python -m experiments.kernel_bench --config=experiments/configs/kernel_bench.py:cpu

For each op and implementation: correctness against the reference on the same arrays first, then
interleaved timing rounds (the order rotates each round) with medians; bytes that must move (valid
KV + q + out), achieved GB/s and the fraction of ``--peak_gbps``; and the ratio to dense contiguous
attention (`pallas_kernels.flash_attention`, same implementation family) on a contiguous copy of the
same data: the cost of paging. With ``dense_head_major`` the "xla" family also gets a second dense
baseline on ``[B, Hkv, T, D]`` K/V (no per-block transpose). Writes JSON with the JAX version,
devices, git revision and config.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from pallas_kernels import benchmarking as lib

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    str(Path(__file__).resolve().parent / "configs" / "kernel_bench.py") + ":cpu",
    "Benchmark config (experiments/configs/kernel_bench.py:<cpu|smoke|h200>).",
    lock_config=True,
)
_PEAK = flags.DEFINE_float("peak_gbps", None, "Peak memory bandwidth in GB/s (default: config).")
_OUT = flags.DEFINE_string("out", None, "JSON output path (default: config.out).")


def git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        )  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def git_dirty() -> bool | None:
    """Whether the working tree differs from ``git_revision`` (results then describe uncommitted code)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
            text=True, check=True, cwd=Path(__file__).resolve().parent,
        )  # fmt: skip
        return bool(out.stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return None


def run(config: ml_collections.ConfigDict, *, peak_gbps: float | None = None) -> dict:
    """Runs the benchmark ``config`` describes; returns the JSON-able record."""
    peak = float(peak_gbps or config.peak_gbps)
    rng = np.random.default_rng(config.seed)
    record = {
        "config": config.to_dict(),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "git_revision": git_revision(),
        "git_dirty": git_dirty(),
        "load_average": list(os.getloadavg()),
        "host": platform.platform(),
        "command": " ".join(sys.argv),
        "peak_gbps": peak,
        "note": config.note,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for op in ("decode", "ragged"):
        data = lib.build_decode(config, rng) if op == "decode" else lib.build_ragged(config, rng)
        impls = list(config.decode_impls if op == "decode" else config.ragged_impls)
        record[op] = lib.bench_op(config, op, data, impls, peak_gbps=peak)
        _print_op(op, record[op])
    return record


def _print_op(op: str, rec: dict) -> None:
    print(f"== {op}: {rec['shape']}  (oracle: {rec['oracle']})", flush=True)
    for name, r in rec["impls"].items():
        if "error" in r:
            print(f"  {name:<20} ERROR {r['error'][:160]}")
            continue
        ratio = r.get("ratio_to_dense")
        print(
            f"  {name:<20} ok={r['correct']!s:<5} err={r['max_abs_err']:.2e} "
            f"median={r['median_ms']:9.3f} ms  {r['achieved_gbps']:8.2f} GB/s "
            f"({100 * r['fraction_of_peak']:5.1f}% peak)"
            + (f"  paged/dense={ratio:.3f}" if ratio is not None else "")
            + (f"  paged/dense[{lib.HEAD_MAJOR}]={r['ratio_to_dense_head_major']:.3f}"
               if "ratio_to_dense_head_major" in r else "")
        )  # fmt: skip
    for name, r in rec["dense"].items():
        if "median_ms" in r:
            label = f"dense[{name}]"
            print(f"  {label:<20} ok={r['correct']!s:<5} err={r['max_abs_err']:.2e} "
                  f"median={r['median_ms']:9.3f} ms")  # fmt: skip


def main(argv) -> None:
    del argv
    config = _CONFIG.value
    record = run(config, peak_gbps=_PEAK.value)
    out = _OUT.value or config.out
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=1, default=float) + "\n")
        print(f"wrote {out}")
    failed = [
        f"{op}:{name}"
        for op in ("decode", "ragged")
        for name, r in record[op]["impls"].items()
        if not r.get("correct", False)
    ]
    if failed:
        print(f"FAILED correctness or errored: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
