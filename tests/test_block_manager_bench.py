"""The block-manager benchmark runs end to end on its smoke config and writes a labelled record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_config_writes_a_constructed_record(tmp_path):
    out = tmp_path / "bench.json"
    # A subprocess: absl flags are process-global and other experiments also define --config.
    subprocess.run(
        [sys.executable, "-m", "experiments.block_manager_bench",
         "--config=experiments/configs/block_manager_bench.py:smoke", f"--config.out={out}"],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    record = json.loads(out.read_text())
    assert record["evidence"] == "constructed"
    assert record["config"]["name"] == "smoke" and record["python"] and record["provenance"]["git_commit"]
    for api in ("per_seq", "batch"):
        replay = record["replay"][api]
        assert replay["decode_step_at_max_running_cpu"]["n"] > 0
        stats = replay["block_manager_stats"]
        assert stats["allocations"] >= record["trace"]["num_requests"]
        assert stats["num_used_blocks"] == 0 and stats["hits"] > 0  # all freed; prefixes shared
    assert set(record["micro_us_per_op"]) >= {"append_slots_1_token", "allocate_161_tokens_miss"}
