"""Every experiment's smoke config runs end to end and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from cli_runner import ForkRunner
from engine_utils import host_devices_flags

ROOT = Path(__file__).resolve().parents[1]


STUDIES = ("ablate", "capacity", "cascade", "disagg_engine", "disaggregation", "engine_bench",
           "kv_quant", "kv_tiers", "serve", "sliding_window_capacity", "sparse_decode",
           "spec_decode")
_CLI: list[ForkRunner] = []


@pytest.fixture(scope="module", autouse=True)
def _cli():
    """The smokes run as ``python -m experiments.<study>`` forked from one warm helper
    (`cli_runner.ForkRunner`: Python, JAX and the studies imported once, each run in its own
    child process that starts its own JAX backend)."""
    with ForkRunner(["experiments.common", "experiments.replay",
                     *(f"experiments.{s}" for s in STUDIES)], ROOT) as r:
        _CLI.append(r)
        yield
        _CLI.clear()


def _run(module: str, *flags: str) -> subprocess.CompletedProcess:
    assert module.removeprefix("experiments.") in STUDIES, module  # preloaded in the helper
    proc = _CLI[0].run(module, *flags, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_serve_smoke(tmp_path):
    out = tmp_path / "serve"
    proc = _run("experiments.serve", "--config=experiments/configs/serve.py:smoke",
                f"--config.output_dir={out}")
    assert "paged+continuous" in proc.stdout and "contiguous+static" in proc.stdout
    # Off a terminal (captured here), progress is one summary line per arm, no carriage returns.
    assert "\r" not in proc.stderr and "\r" not in proc.stdout
    # (each arm's warmup says once how many shapes it compiles)
    progress = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("warmup: ")]
    assert len(progress) <= 6, proc.stderr[-2000:]  # two arms, each on two workloads
    assert any("[paged+continuous] 6/6" in line for line in progress), proc.stderr[-2000:]
    payload = json.loads((out / "summary.json").read_text())
    assert payload["evidence"] == "constructed"
    assert payload["provenance"]["jax_version"]
    for arm in payload["arms"]:
        s = arm["summary"]
        assert s["completed"] == s["num_requests"] == 6
        assert len(arm["records"]) == 6
        assert arm["trace"]["time_s"], "KV usage trace is empty"
        # vLLM benchmark_serving's field names, per-request arrays in record order.
        assert s["duration"] > 0 and "duration_s" not in s
        for key in ("input_lens", "output_lens", "ttfts", "itls", "errors"):
            assert len(s[key]) == 6, key
        assert s["errors"] == [""] * 6 and sum(s["output_lens"]) == s["total_output_tokens"]
    assert (out / "latency_cdf.png").stat().st_size > 0 and (out / "kv_usage.png").stat().st_size > 0
    # The real-arrival window: one line per arm, its own label and records.
    real = payload["real_arrivals"]
    assert real["evidence"] == "real" and real["label"].startswith(
        "evidence: real, derived: [window 18:35:46-18:35:47, lengths x0.03125, lengths clipped")
    n = real["workload"]["summary"]["num_requests"]
    assert [a["name"] for a in real["arms"]] == ["paged+continuous", "contiguous+static"]
    assert all(len(a["records"]) == n == a["summary"]["num_requests"] for a in real["arms"])
    assert "real arrivals: " in proc.stdout and proc.stdout.count("goodput") >= 2
    # Every arm left a replay record; the paged arm re-executes exactly (tokens and batches).
    from experiments import replay as rp

    records = rp.load_records(str(out))
    assert [r["arm"] for r in records] == [
        "paged+continuous", "contiguous+static", "real_arrivals/paged+continuous",
        "real_arrivals/contiguous+static"]
    assert f"replay: {rp.replay_command(out)}" in proc.stdout
    result = rp.replay(records[0])
    assert result.ok, f"{result.divergence.format()}\nreproduce: {rp.replay_command(out, 'paged+continuous')}"


def test_engine_bench_smoke(tmp_path):
    _run("experiments.engine_bench", "--config=experiments/configs/engine_bench.py:smoke",
         f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "engine_bench.json").read_text())
    rows = payload["results"]
    assert [(r["mode"], r["num_running"]) for r in rows] == [("steady", 4), ("churn", 4)]
    assert all(r["median_host_ms"] > 0 and r["off_median_device_ms"] > 0 for r in rows)
    steady, churn = rows
    # Overlap on, off and isolated blocks, each after one untimed switch step.
    assert steady["batched_decode_steps"] >= 3 * steady["steps"]
    assert steady["off_median_step_ms"] > 0 and steady["overlap_speedup"] > 0
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
    proc = _CLI[0].run("experiments.serve", "--config=experiments/configs/serve.py:smoke", bad,
                       f"--config.output_dir={tmp_path / 'out'}", timeout=300)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("serve: workload.rate=-1"), proc.stderr
    assert "must be" in lines[0]
    assert not (tmp_path / "out").exists()  # nothing written: it failed before any work


def _replays_exactly(out: Path, arms: list[str], stdout: str, devices: int = 1) -> None:
    """``python -m experiments.replay --from=out`` re-executes every arm (one per run) of the
    study's ``replay.json`` to the same batches and tokens (on ``devices`` forced host devices);
    on failure, the command to rerun."""
    import os

    from experiments import replay as rp

    how = f"reproduce: {rp.replay_command(out, devices=devices)}"
    assert f"replay: {rp.replay_command(out, devices=devices)}" in stdout
    assert [r["arm"] for r in rp.load_records(str(out))] == arms, how
    if devices == 1:  # forked from the warm helper (a fresh `python -m`, less the imports)
        proc = _CLI[0].run("experiments.replay", f"--from={out}", timeout=600)
    else:  # forced host devices: XLA_FLAGS must be set before JAX starts, so a new process
        env = dict(os.environ, XLA_FLAGS=host_devices_flags(devices), JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-m", "experiments.replay", f"--from={out}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}{proc.stderr[-2000:]}\n{how}"
    assert proc.stdout.count("] identical: ") == len(arms), proc.stdout


def test_ablate_smoke(tmp_path):
    proc = _run("experiments.ablate", "--config=experiments/configs/ablate.py:smoke",
                f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "ablate.json").read_text())
    assert len(payload["arms"]) == 4  # kv_layout x scheduling in the smoke grid
    assert set(payload["main_effects"]) == {"kv_layout", "scheduling"}
    assert "main effects" in proc.stdout
    # Every cell (a new engine each) replays exactly.
    _replays_exactly(tmp_path, [a["name"] for a in payload["arms"]], proc.stdout)


def test_capacity_smoke(tmp_path):
    proc = _run("experiments.capacity", "--config=experiments/configs/capacity.py:smoke",
                f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "capacity.json").read_text())
    assert [a["name"] for a in payload["arms"]] == ["paged+continuous", "contiguous+static"]
    for arm in payload["arms"]:
        assert arm["capacity_rps"] == max(p["rate"] for p in arm["points"] if p["meets_slo"])
    assert "ratio" in proc.stdout and (tmp_path / "capacity.png").exists()
    # Every point (a new engine each) replays exactly, named <arm>@<rate>.
    _replays_exactly(tmp_path, [f"{a['name']}@{p['rate']:g}" for a in payload["arms"]
                                for p in a["points"]], proc.stdout)


def test_capacity_kv_dtype_smoke(tmp_path):
    """The KV format as the capacity factor: every arm's pool is what one byte budget holds in
    its own format (the priced bfloat16 arm: bfloat16's blocks, float32 pages), every point ran
    on that pool, and each arm's decode step was timed."""
    from experiments import common
    from paged import accounting

    _run("experiments.capacity", "--config=experiments/configs/capacity.py:kv_dtype_smoke",
         f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "capacity.json").read_text())
    budget = payload["config"]["kv_budget_bytes"]
    model_config = common.load_model(payload["config"]["model"])[0]
    arms = {a["name"]: a for a in payload["arms"]}
    assert list(arms) == ["int8:token", "bfloat16 (priced)", "fp8_e4m3:page"]
    for name, kv, gran, stored in (("int8:token", "int8", "token", "float32"),
                                   ("bfloat16 (priced)", "auto", "token", "bfloat16"),
                                   ("fp8_e4m3:page", "fp8_e4m3", "page", "float32")):
        spec = accounting.ModelSpec.from_model_config(model_config, dtype=stored,
                                                      kv_cache_dtype=kv, scale_granularity=gran)
        pool = arms[name]["pool"]
        assert pool["num_blocks"] == budget // spec.bytes_per_block(8) == spec.blocks_for_bytes(
            budget, 8)
        assert pool["priced_pool_bytes"] <= budget
        real = arms[name]["points"][0]["summary"]
        assert real["kv_num_blocks"] == pool["num_blocks"]
        # the engine's pool bytes (its ledger): the priced arm stores float32, twice bfloat16
        assert real["pool_bytes"] == pool["priced_pool_bytes"] * (2 if kv == "auto" else 1)
        assert arms[name]["decode_probe"]["median_step_ms"] > 0
    assert arms["int8:token"]["pool"]["num_blocks"] > arms["bfloat16 (priced)"]["pool"]["num_blocks"]
    assert arms["fp8_e4m3:page"]["pool"]["scale_bytes_per_block"] < arms["int8:token"]["pool"][
        "scale_bytes_per_block"]
    assert (tmp_path / "capacity.png").exists()


def test_progress_off_a_terminal_is_one_summary_line():
    import io

    from experiments.common import Progress

    out = io.StringIO()  # not a TTY: no bar, no carriage returns, one line when it closes
    with Progress(120, "[arm]", file=out) as bar:
        for i in range(120):
            bar.set(i + 1, running=3, waiting=0)
    assert "\r" not in out.getvalue()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[arm] 120/120 req in "), lines
    quiet = io.StringIO()
    with Progress(3, "[x]", file=quiet, summary=False) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""
    # One helper for the library, the server's warmup and the studies; lines=True: a line per
    # update (count and elapsed time), for loops with long steps.
    import paged.util.progress_bar

    assert Progress is paged.util.progress_bar.Progress
    lines = io.StringIO()
    with Progress(2, "warmup", file=lines, unit="step shapes", lines=True, summary=False) as bar:
        bar.set(1, shape="8x1x1 plain")
        bar.update()
    got = lines.getvalue().splitlines()
    assert [g.split(",")[0] for g in got] == ["warmup 1/2 step shapes", "warmup 2/2 step shapes"]
    assert got[0].endswith("(shape 8x1x1 plain)") and " s" in got[1]
    studies = Path(__file__).resolve().parents[1] / "experiments"
    for name in ("ablate", "block_size_sweep", "engine_bench", "online_vs_offline",
                 "prefix_sharing", "train_tiny", "serving", "spec_decode", "sim_validate"):
        assert "common.Progress(" in (studies / f"{name}.py").read_text(), name


def test_spec_decode_smoke(tmp_path):
    proc = _run("experiments.spec_decode", "--config=experiments/configs/spec_decode.py:smoke",
                f"--config.output_dir={tmp_path}")
    # The load sweep's timed runs (on engines reused from batch 1) start cold and replay exactly.
    _replays_exactly(tmp_path, ["off@500#0", "on@500#0"], proc.stdout.replace(
        "replay (load runs): ", "replay: "))
    payload = json.loads((tmp_path / "spec_decode.json").read_text())
    rows = payload["results"]
    assert payload["evidence"] == "constructed" and {r["k"] for r in rows} == {1, 3}
    assert {r["batch"] for r in rows} == {1}
    code = [r for r in rows if r["prompts"] == "code" and r["batch"] == 1]
    assert {r["method"] for r in rows} == {"ngram"}
    assert all(r["verify_rows"] > 0 and 0 <= r["alpha"] <= 1 for r in code)
    assert (tmp_path / "spec_decode.png").stat().st_size > 0


def test_kv_quant_smoke(tmp_path):
    _run("experiments.kv_quant", "--config=experiments/configs/kv_quant.py:smoke",
         f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "kv_quant.json").read_text())
    assert payload["evidence"] == "constructed" and payload["provenance"]["jax_version"]
    rows = [r for r in payload["results"] if "kv_cache_dtype" in r]
    assert {(r["kv_cache_dtype"], r["kv_scale_granularity"]) for r in rows} == {
        ("int8", "token"), ("fp8_e5m2", "page")}
    for r in rows:
        assert 0 <= r["greedy_agreement"] <= 1 and 0 <= r["top1_agreement"] <= 1
        assert r["kl_mean"] >= 0 and r["prompt_logprob_abs_err"] > 0
    [cap] = [r["capacity_at_equal_bytes"] for r in payload["results"] if "capacity_at_equal_bytes" in r]
    assert cap["pages"]["int8:token"] > cap["pages"]["bfloat16"]


def test_cascade_smoke(tmp_path):
    _run("experiments.cascade", "--config=experiments/configs/cascade.py:smoke",
         f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "cascade.json").read_text())
    assert payload["all_correct"] and payload["provenance"]["jax_version"]
    points = payload["points"]
    assert {(p["group_size"], p["prefix_tokens"]) for p in points} == {
        (1, 32), (1, 64), (4, 32), (4, 64)}
    for p in points:
        assert p["ratio"]["rounds"] == 3 and p["cascade_ms"]["median"] > 0
        # A group of n reads its prefix once: n * (prefix + suffix pages) vs prefix + n * suffix.
        n, pages = p["group_size"], p["prefix_tokens"] // 16
        bytes_per_page = 16 * 2 * 2 * 16 * 4  # page x K,V x Hkv x D x float32
        assert p["kv_bytes"]["ordinary"] == n * (pages + 1) * bytes_per_page
        assert p["kv_bytes"]["cascade"] == (pages + n) * bytes_per_page
    assert set(payload["derived"]["crossovers"]) == {"1", "4"}
    assert (tmp_path / "cascade.png").stat().st_size > 0


def test_sparse_decode_smoke(tmp_path):
    _run("experiments.sparse_decode", "--config=experiments/configs/sparse_decode.py:smoke",
         f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "sparse_decode.json").read_text())
    assert [(p["context"], p["fraction"]) for p in payload["points"]] == [(256, 0.25), (512, 0.25)]
    for p in payload["points"]:
        # 1/4 of the pages (K and V), plus 2 bound rows per 16-token page: 1/4 + 1/16.
        assert p["bytes"]["dense"] == 2 * 2 * p["context"] * 2 * 16 * 4  # B, Hkv, K+V, D, f32
        assert p["bytes_ratio"] == pytest.approx(0.25 + 1 / 16)
        assert p["sparse_ms"] > 0 and p["time_ratio"]["rounds"] == 2


def test_sparse_decode_arms():
    from experiments import sparse_decode

    assert sparse_decode.parse_arm("dense") == (None, 0, "max", 0)
    assert sparse_decode.parse_arm("0.125:2") == (0.125, 2, "max", 0)
    assert sparse_decode.parse_arm("0.0625:0:union") == (0.0625, 0, "union", 0)
    assert sparse_decode.parse_arm("0.125:2:max:4") == (0.125, 2, "max", 4)
    for bad in ("0.125", "0:2", "0.5:2:mean", "0.5:-1", "0.5:2:rank:x", "0.5:2:max:-1",
                "0.5:2:max:1:1"):
        with pytest.raises(ValueError, match="F:L"):
            sparse_decode.parse_arm(bad)


def test_disaggregation_smoke(tmp_path):
    proc = _run("experiments.disaggregation",
                "--config=experiments/configs/disaggregation.py:smoke",
                f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "disaggregation.json").read_text())
    assert payload["evidence"] == "simulated" and payload["workload_evidence"] == "real"
    assert payload["provenance"]["git_revision"] and len(payload["load_average"]) == 3
    [fleet] = payload["results"]["conv"]["fleets"]
    points = fleet["points"]
    # Colocated and every split of 4 GPUs, at each rate of the grid.
    assert sorted({p["prefill"] for p in points}) == [0, 1, 2, 3]
    assert sorted({p["rate_per_gpu"] for p in points}) == [2.0, 8.0]
    for p in points:
        s = p["summary"]
        assert 0 <= p["attainment"]["2000/100"] <= 1
        assert (s["num_handovers"] is None) == (p["prefill"] == 0)
        if p["prefill"]:  # every hand-over moved 2 L n h_kv d_h b bytes of Llama-3-8B
            assert s["kv_transfer_bytes"] % (2 * 32 * 8 * 128 * 2) == 0
    [row] = fleet["comparison"]
    gp = row["goodput_per_gpu"]
    assert set(gp) == {"colocated", "1:3", "2:2", "3:1"}
    best = max(v or 0 for k, v in gp.items() if k != "colocated")
    assert row["best_split_goodput"] == (best or None)
    assert "goodput/GPU colocated" in proc.stdout
    from experiments.disaggregation import combine

    both = combine([payload, payload])["results"]["conv"]["fleets"][0]
    assert both["comparison"] == fleet["comparison"] and len(both["points"]) == len(points)
    assert (tmp_path / "attainment_conv_4gpu.png").stat().st_size > 0
    assert (tmp_path / "goodput_per_gpu.png").stat().st_size > 0

@pytest.mark.parametrize("variant", ["kv_dtype_smoke", "window_smoke", "window_fractions_smoke",
                                     "cascade_smoke"])
def test_fleet_kv_whatifs_smoke(tmp_path, variant):
    """The fleet study's KV what-ifs (experiments/fleet_whatifs.py): every arm has a capacity
    row, its pool sized from one byte budget in its own format, its roofline in that format."""
    from experiments import fleet
    from experiments.configs import fleet as fleet_config
    from paged.sim.specs import MODELS

    c = fleet_config.get_config(variant)
    c.output_dir = str(tmp_path)
    fleet.main(c, fleet.check(c))
    payload = json.loads((tmp_path / "fleet.json").read_text())
    assert payload["evidence"] == "simulated" and payload["provenance"]["git_revision"]
    study = variant.removesuffix("_smoke").removesuffix("_fractions")
    [(name, rows)] = [(n, r[study]) for n, r in payload["results"].items() if study in r]
    model = MODELS[name]
    for row in rows:
        assert row["capacity_rps"] and all(p["evidence"] == "simulated" for p in row["points"])
        eng, dims = row["engine"], row["step_model"]["model"]
        assert dims["kv_cache_dtype"] == eng["kv_cache_dtype"]
        per_block = model.with_kv_cache(types.SimpleNamespace(**eng)).kv_bytes_per_block(
            eng["block_size"])
        assert eng["num_blocks"] == int(row["kv_bytes"] // per_block) + 1
    if study == "kv_dtype":
        blocks = {r["engine"]["kv_cache_dtype"]: r["engine"]["num_blocks"] for r in rows}
        assert blocks["int8"] == blocks["fp8_e4m3"] > 1.9 * blocks["auto"]  # 1 byte + f32 scales
        arms = payload["traces"]["conv"]["arms"]
        assert [a["step_model"]["model"]["kv_cache_dtype"] for a in arms] == [
            "auto", "fp8_e4m3", "int8"]
    if variant == "window_fractions_smoke":  # windows of 1/8, 1/4, 1/2 of 1,024, then full
        windows = [r["step_model"]["model"]["sliding_window"] for r in rows]
        assert windows == [128, 256, 512, None]
        held = [r["at_capacity"]["max_blocks_per_sequence"] for r in rows]
        assert held[:3] == sorted(held[:3]) and held[-1] == (64 + 896) // 16
        for w, h in zip(windows[:3], held):
            assert h <= w // 16 + 1
        assert all(r["at_capacity"]["recycled_blocks"] > 0 for r in rows[:3])
        assert rows[-1]["at_capacity"]["recycled_blocks"] == 0
    elif study == "window":
        win, full = rows
        assert win["step_model"]["model"]["sliding_window"] == 4096
        assert full["step_model"]["model"]["sliding_window"] is None
        assert win["at_capacity"]["max_blocks_per_sequence"] <= 4096 // 16 + 1 < \
            full["at_capacity"]["max_blocks_per_sequence"]
    if study == "cascade":
        by = {r["engine"]["cascade_attention"]: r["at_capacity"] for r in rows}
        assert by["off"]["cascade_steps"] == 0 < by["on"]["cascade_steps"]


def test_sliding_window_capacity_smoke(tmp_path):
    """Full attention and one window at the same pool, each swept over two rates on the CPU
    engine: a capacity per arm, recycling only in the window arm, the ratio over full."""
    _run("experiments.sliding_window_capacity",
         "--config=experiments/configs/sliding_window_capacity.py:smoke",
         f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "capacity.json").read_text())
    assert payload["evidence"] == "constructed" and payload["provenance"]["git_revision"]
    full, win = payload["arms"]
    assert (full["sliding_window"], win["sliding_window"]) == (None, 8)  # 0.25 x 32
    for arm in (full, win):
        assert [p["rate"] for p in arm["points"]] == [8.0, 16.0]
        assert arm["capacity_rps"] == 16.0  # the smoke's SLO is loose: both rates meet it
    for p in win["points"]:
        assert p["kv"]["recycled_blocks"] > 0 and p["kv"]["recycled_bytes"] > 0
        assert p["kv"]["max_blocks_per_sequence"] <= 8 // 4 + 1 + 1  # + 1: async stepping
    assert all(p["kv"]["recycled_blocks"] == 0 for p in full["points"])
    assert payload["capacity_over_full"] == {win["name"]: 1.0}


def test_disagg_engine_smoke(tmp_path):
    proc = _run("experiments.disagg_engine",
                "--config=experiments/configs/disagg_engine.py:smoke",
                f"--config.output_dir={tmp_path}")
    payload = json.loads((tmp_path / "disagg_engine.json").read_text())
    assert payload["functional_check"] is True and "not a performance claim" in payload["note"]
    colocated, split = payload["arms"]
    assert [r["role"] for r in colocated["replicas"]] == ["both"] * 4
    assert [r["role"] for r in split["replicas"]] == ["prefill"] + ["decode"] * 3
    assert split["handovers"]["count"] == 6 and split["roles_kept"] and split["all_finished"]
    # Both arms replay exactly on four devices: routing, every replica's batches, hand-overs.
    _replays_exactly(tmp_path, ["colocated", "P:D=1:3"], proc.stdout, devices=4)

def test_kv_tiers_smoke(tmp_path):
    proc = _run("experiments.kv_tiers", "--config=experiments/configs/kv_tiers.py:smoke",
                f"--config.output_dir={tmp_path}")
    # A smoke run says, first and last, that it is a plumbing check (experiments.common.run).
    lines = proc.stdout.strip().splitlines()
    assert "not a measurement" in lines[0] and "not a measurement" in lines[-1], proc.stdout
    payload = json.loads((tmp_path / "kv_tiers.json").read_text())
    assert payload["smoke"] is True and payload["provenance"]["smoke"] is True
    assert payload["evidence"] == "constructed" and payload["provenance"]["jax_version"]
    off, on = payload["arms"]
    assert (off["host_multiplier"], on["host_multiplier"]) == (0, 4)
    assert off["completed"] == on["completed"] == 12
    assert payload["workload"]["meta"]["distinct_prefix_blocks"] > payload["engine_config"][
        "num_blocks"]
    assert off["host_hit_rate"] == 0 and on["host_hit_rate"] > 0
    assert on["host_tier"]["offloaded_blocks"] > 0 and on["host_tier"]["loaded_blocks"] > 0
    assert on["host_kv_cache_bytes"] == 4 * payload["device_pool_bytes"]
    for arm in (off, on):
        assert 0 < arm["ttft_p50_s"] <= arm["ttft_p99_s"] and arm["throughput_tok_s"] > 0


def test_host_tier_fleet_smoke(tmp_path):
    """The simulated sizing study: every arm has a capacity and a run at the tier-off arm's
    capacity; the tier serves hits the device alone does not, priced on the link."""
    from experiments import host_tier_fleet
    from experiments.configs import host_tier_fleet as config

    c = config.get_config("smoke")
    c.output_dir = str(tmp_path)
    host_tier_fleet.main(c, host_tier_fleet.check(c))
    payload = json.loads((tmp_path / "host_tier_fleet.json").read_text())
    assert payload["evidence"] == "simulated" and payload["provenance"]["git_revision"]
    assert payload["workload"]["distinct_over_pool"] > 2
    off, on = payload["conversations"]
    assert (off["host_multiplier"], on["host_multiplier"], on["link"]) == (0, 4, "pcie5")
    assert off["capacity_rps"] and on["capacity_rps"]
    assert on["host_kv_cache_bytes"] == 4 * payload["device_pool_bytes"]
    a, b = off["at_reference"], on["at_reference"]
    assert a["rate"] == b["rate"] == off["capacity_rps"]
    assert a["host_hit_rate"] == 0 and b["host_hit_rate"] > 0
    assert b["prefill_tokens"] < a["prefill_tokens"]
    assert b["summary"]["host_tier_load_s"] > 0 and b["summary"]["host_tier_offload_s"] > 0
    azure = payload["azure"]
    assert azure["workload_evidence"] == "real" and "window" in azure["label"]
    assert [r["point"]["summary"]["completed"] > 0 for r in azure["arms"]] == [True, True]
