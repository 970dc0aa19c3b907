"""Tests for experiments/fragmentation.py: helpers in-process, the script in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments import fragmentation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = [37, 91, 128, 201, 511]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.fragmentation", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_layout_rows_reproduce_seed_table():
    rows = fragmentation.layout_rows(SEED, [16, 32], 512)
    assert [r["allocated_positions"] for r in rows] == [2560, 992, 1024]
    assert {r["valid_positions"] for r in rows} == {968}
    assert [round(100 * r["position_utilization"], 2) for r in rows] == [37.81, 97.58, 94.53]
    # i32 tables, one row of ceil(512/B) entries per sequence; the reservation needs none.
    assert [r["block_table_bytes"] for r in rows] == [0, 5 * 32 * 4, 5 * 16 * 4]
    assert [r["num_blocks"] for r in rows] == [None, 62, 32]


def test_sequence_rows():
    rows = fragmentation.sequence_rows([37, 201], [16, 32], 512)
    assert rows[0] == {
        "n": 37,
        "fixed": {"A": 512, "W": 475},
        "paged": {"16": {"A": 48, "W": 11}, "32": {"A": 64, "W": 27}},
    }
    assert rows[1]["paged"]["32"] == {"A": 224, "W": 23}


@pytest.mark.parametrize(
    "lengths, block_sizes, max_len, match",
    [
        (["1", "x"], ["16"], 512, "'x' is not an integer"),
        (["-3"], ["16"], 512, "-3 must be"),
        (["3"], ["0"], 512, "block_sizes: 0"),
        (["600"], ["16"], 512, "exceed max_len=512"),
        (["3"], ["16"], 0, "max_len: 0"),
        ([], ["16"], 512, "lengths is empty"),
    ],
)
def test_parse_inputs_rejects(lengths, block_sizes, max_len, match):
    with pytest.raises(ValueError, match=match):
        fragmentation.parse_inputs(lengths, block_sizes, max_len)


def test_script_end_to_end(tmp_path):
    proc = _run("--config.block_sizes=8,16,32,64,128", "--config.max_len=512",
                f"--config.output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "fragmentation.json"
    assert "37.81%" in proc.stdout and "97.58%" in proc.stdout and "94.53%" in proc.stdout
    report = json.loads(out.read_text())
    assert report["evidence"] == "constructed" and report["seed_example"] is True
    assert report["inputs"] == {
        "lengths": SEED,
        "block_sizes": [8, 16, 32, 64, 128],
        "max_len": 512,
    }
    alloc = {r["block_size"]: r["allocated_positions"] for r in report["layouts"]}
    assert alloc[None] == 2560 and alloc[16] == 992 and alloc[32] == 1024
    assert {"git_revision", "git_commit", "python_version", "numpy", "utc_time"} <= set(
        report["provenance"])
    assert len(report["sequences"]) == 5


def test_smoke_variant(tmp_path):
    proc = _run("--config=experiments/configs/fragmentation.py:smoke",
                f"--config.output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "fragmentation.json").read_text())
    assert report["inputs"] == {"lengths": [5, 17, 40], "block_sizes": [4, 16], "max_len": 64}
    assert report["seed_example"] is False


@pytest.mark.parametrize(
    "flag",
    ["--config.lengths=1,x", "--config.block_sizes=0", "--config.lengths=600",
     "--config.max_len=abc", "--nope=1", "--config.block_size=16"],
)
def test_script_bad_flag_one_line(flag, tmp_path):
    proc = _run(flag, f"--config.output_dir={tmp_path / 'out'}")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fragmentation:"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
