"""Every study fails fast on a mistake: one line on stderr naming the key, non-zero exit, no
traceback, nothing written. Each case stops before any model is loaded, so the command lines run
through one warm `cli_runner.ForkRunner` (forked ``python -m``; about 0.1 s each instead of 2 s of
Python and JAX start-up)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_runner import ForkRunner

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "experiments" / "traces" / "tiny_constructed.jsonl"

# (study, variant, a mistyped key with the key the message must suggest, a bad value, its key)
CASES = [
    ("serve", "smoke", "engine.block_sz=8", "engine.block_size", "engine.block_size=0",
     "engine.block_size"),
    ("ablate", "smoke", "workload.rat=4", "workload.rate", "workload.rate=-1", "workload.rate"),
    ("capacity", "smoke", "engine.polcy=x", "engine.policy", "engine.policy=sideways",
     "engine.policy"),
    ("block_size_sweep", "smoke", "engine.max_model_lenn=64", "engine.max_model_len",
     "block_sizes=(4,0)", "block_sizes"),
    ("prefix_sharing", "smoke", "workload.num_request=3", "workload.num_requests",
     "engine.attention_impl=pallas", "engine.attention_impl"),
    ("engine_bench", "smoke", "engine.block_size_=8", "engine.block_size", "steps=0", "steps"),
    ("fragmentation", "smoke", "max_lenn=64", "max_len", "block_sizes=(0,)", "block_sizes"),
    ("train_tiny", "smoke", "stepz=3", "steps", "warmup_steps=9", "warmup_steps"),
    ("spec_decode", "smoke", "max_tokenz=3", "max_tokens", "ks=(0,)", "ks"),
    ("calibrate", "smoke", "stepz=3", "steps", "steps=0", "steps"),
    ("sim_validate", "smoke", "duration=3", "duration_s", "duration_s=0", "duration_s"),
    ("fleet", "smoke", "kv_gbb=3", "kv_gb", "rate_hi=-1", "rate_hi"),
    ("trace_stats", "smoke", "rate_bin=3", "rate_bin_s", "rate_bin_s=0", "rate_bin_s"),
    ("routing", "smoke", "data_parallel_siz=4", "data_parallel_size", "host_bench.steps=0",
     "host_bench.steps"),
    ("sliding_window", "smoke", "window_fraction=(0.5,)", "window_fractions",
     "window_fractions=(0.05,)", "window_fractions"),
    ("cascade", "smoke", "group_size=2", "group_sizes", "group_sizes=abc", "group_sizes"),
    ("sparse_decode", "smoke", "fraction=(0.5,)", "fractions", "fractions=(0,)", "fractions"),
]


@pytest.fixture(scope="module")
def cli():
    with ForkRunner(["experiments.common", *(f"experiments.{c[0]}" for c in CASES)], ROOT) as r:
        yield r


def _run(cli: ForkRunner, study: str, variant: str, *flags: str,
         out: Path) -> subprocess.CompletedProcess:
    return cli.run(f"experiments.{study}", f"--config=experiments/configs/{study}.py:{variant}",
                   *flags, f"--config.output_dir={out}", timeout=120)


def _one_line(proc: subprocess.CompletedProcess, study: str, out: Path) -> str:
    assert proc.returncode not in (0, None), proc.stdout[-1000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{study}: "), proc.stderr[-3000:]
    assert not out.exists(), "a failed run wrote output"
    return lines[0]


@pytest.mark.parametrize("study, variant, typo, suggestion, bad, bad_key", CASES,
                         ids=[c[0] for c in CASES])
def test_typo_and_bad_value_end_in_one_line(cli, tmp_path, study, variant, typo, suggestion, bad,
                                            bad_key):
    out = tmp_path / "out"
    line = _one_line(_run(cli, study, variant, f"--config.{typo}", out=out), study, out)
    assert repr(typo.split("=")[0]) in line and suggestion in line.split("closest:")[1], line
    line = _one_line(_run(cli, study, variant, f"--config.{bad}", out=out), study, out)
    assert bad_key in line, line


@pytest.mark.parametrize("flags, words", [
    (["--config.engine.block_size=abc"], ["engine.block_size='abc'", "int"]),
    (["--nope=1"], ["--nope"]),
    (["extra"], ["unexpected arguments"]),
    (["--config.engine.kv_layout=contiguous"], ["engine.kv_layout", "config.arms"]),
    (["--config.model=huge"], ["model='huge'", "tiny"]),
    (["--config.engine.model=tiny"], ["engine.model", "use --config.model=tiny"]),
])
def test_serve_mistakes(cli, tmp_path, flags, words):
    out = tmp_path / "out"
    line = _one_line(_run(cli, "serve", "smoke", *flags, out=out), "serve", out)
    for word in words:
        assert word in line, line


def test_unknown_variant(cli, tmp_path):
    out = tmp_path / "out"
    line = _one_line(_run(cli, "serve", "nope", out=out), "serve", out)
    assert "unknown variant 'nope'" in line and "smoke" in line


def test_every_engine_field_is_a_config_key(tmp_path):
    """`EngineConfig` fields are generated into every study's config.engine, typed."""
    import dataclasses
    import importlib

    from paged.config.engine_config import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    for study in ("serve", "ablate", "capacity", "block_size_sweep", "prefix_sharing",
                  "engine_bench", "routing", "sliding_window"):
        for variant in ("default", "smoke"):
            c = importlib.import_module(f"experiments.configs.{study}").get_config(variant)
            assert set(c.engine.keys()) == names, (study, variant)
    c = importlib.import_module("experiments.configs.serve").get_config("smoke")
    assert c.engine.get_type("num_blocks") is int and c.engine.get_type("request_timeout_s") is float


def test_headerless_trace_needs_a_label(cli, tmp_path):
    body = [line for line in TRACE.read_text().splitlines() if '"workload"' not in line]
    trace = tmp_path / "no_header.jsonl"
    trace.write_text("\n".join(body) + "\n")
    out = tmp_path / "out"
    line = _one_line(_run(cli, "serve", "smoke", f"--config.workload.trace={trace}", out=out),
                     "serve", out)
    assert "evidence" in line and "header" in line, line
    line = _one_line(_run(cli, "serve", "smoke", f"--config.workload.trace={trace}",
                          "--config.workload.evidence=measured", out=out), "serve", out)
    assert "evidence='measured'" in line and "simulated" in line, line
