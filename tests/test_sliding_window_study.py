"""The sliding-window study runs end to end on its smoke config (same pool, full vs windows)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sliding_window_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.sliding_window",
         "--config=experiments/configs/sliding_window.py:smoke", f"--config.output_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((tmp_path / "sliding_window.json").read_text())
    assert payload["evidence"] == "constructed" and payload["provenance"]["jax_version"]
    assert "peak run" in proc.stdout
    arms = payload["arms"]
    # smoke: max_model_len 32, B = 4, 20 usable blocks, 6 requests of 4 + 20 tokens.
    assert [a["sliding_window"] for a in arms] == [None, 4, 8, 16]
    full, *windows = arms
    for a in arms:
        assert a["output_tokens"] == a["expected_output_tokens"] == 6 * 20, a["arm"]
        assert a["recycled_bytes"] == a["recycled_blocks"] * a["bytes_per_block"]
        assert len(a["trace"]["mean_blocks"]) == a["steps"] > 0
        assert max(a["trace"]["max_blocks"]) <= a["max_blocks_per_sequence"]
    # Full attention keeps every block: a sequence reaches ceil(23 / 4) = 6 blocks (its last
    # token's KV is never written), the pool cannot hold all six, so some are preempted.
    assert full["recycled_blocks"] == 0
    assert full["max_blocks_per_sequence"] == full["bound_blocks_per_sequence"] == 6
    assert full["preemptions"] > 0
    for a in windows:
        w = a["sliding_window"]
        assert a["recycled_blocks"] > 0, a["arm"]
        assert math.ceil(w / 4) + 2 == a["bound_blocks_per_sequence"]  # + 1: async stepping
        # A sequence preempted by recompute is readmitted with all its prompt blocks at once.
        assert a["max_blocks_per_sequence"] <= (
            a["bound_blocks_per_sequence"] if a["preemptions"] == 0 else 6), a["arm"]
    # W = 4: at most three blocks per sequence, all six fit at once: no preemption, more running on average.
    assert windows[0]["preemptions"] == 0
    assert windows[0]["mean_running_seqs"] > full["mean_running_seqs"]
    assert windows[0]["median_running_seqs"] >= full["median_running_seqs"]
    assert windows[0]["steps"] < full["steps"]
