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
    assert record["complete"] is True
    for op in ("decode", "ragged"):
        impls = record[op]["impls"]
        assert set(impls) == set(record["config"][f"{op}_impls"])
        assert record[op]["oracle_check"]["correct"] and record[op]["oracle_check"]["seqs"]
        assert record[op]["copy"]["gbps"] > 0
        for name, r in impls.items():
            assert r["correct"], (op, name, r)
            assert r["median_ms"] > 0 and r["quick_median_ms"] > 0
            assert r["achieved_gbps"] > 0 and r["ratio_to_dense"] > 0
            assert r["fraction_of_copy"] > 0
        assert record[op]["dense"]["xla_head_major"]["correct"]
        assert impls["xla"]["ratio_to_dense_head_major"] > 0
        assert record[op]["bytes"] > 0


def test_configs_load_and_reject_unknown_variants():
    from experiments.configs import kernel_bench

    for name in ("cpu", "smoke", "h200"):
        cfg = kernel_bench.get_config(name)
        assert cfg.name == name and cfg.decode_impls
    with pytest.raises(ValueError, match="unknown variant 'x'"):
        kernel_bench.get_config("x")


@pytest.mark.parametrize("dtype,q_len,causal", [("float32", 1, True), ("bfloat16", 5, True),
                                                ("float32", 5, False)])  # fmt: skip
def test_head_major_dense_baseline_matches_the_standard_layout(dtype, q_len, causal):
    """The bench's second dense baseline: [B, Hkv, T, D] K/V give the same output, NaN tails
    past each length included."""
    import jax
    import numpy as np

    from pallas_kernels import testing, xla

    rng = np.random.default_rng(0)
    caster = testing._caster(dtype)
    k, v = (caster(rng.standard_normal((3, 40, 2, 64))) for _ in range(2))
    lens = np.asarray([40, 17, q_len], np.int32)
    for b, n in enumerate(lens):
        k[b, n:], v[b, n:] = np.nan, np.nan
    q = testing.random_q(rng, (3, q_len, 4, 64), dtype)
    kw = dict(kv_lens=lens, causal=causal, sm_scale=0.125, config=xla.XlaConfig(block_tokens=16))
    want = xla.flash_attention(q, k, v, **kw)
    got = jax.jit(lambda q, k, v: xla.flash_attention(q, k, v, **kw, kv_head_major=True))(
        q, k.swapaxes(1, 2), v.swapaxes(1, 2)
    )
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_a_failing_implementation_is_recorded_and_the_others_go_on():
    """What the first GPU run relies on: an impl that raises (here an unknown name, on the device a
    Triton lowering error) is kept with its type, stage and message, and the rest is still timed;
    the partial record is handed out after every step."""
    import numpy as np

    from experiments.configs import kernel_bench
    from pallas_kernels import benchmarking as lib

    config = kernel_bench.get_config("smoke")
    data = lib.build_decode(config, np.random.default_rng(0))
    snapshots = []
    rec = lib.bench_op(config, "decode", data, ["bogus", "xla"], peak_gbps=1.0,
                       on_update=lambda r: snapshots.append(set(r["impls"])))  # fmt: skip
    bad = rec["impls"]["bogus"]
    assert bad["error_type"] == "ValueError" and bad["error_stage"] == "correctness"
    assert bad["error"].startswith("ValueError: impl='bogus'") and "Traceback" in bad["traceback_tail"]
    assert "median_ms" not in bad
    good = rec["impls"]["xla"]
    assert good["correct"] and good["median_ms"] > 0 and good["fraction_of_copy"] > 0
    assert snapshots[0] == set() and {"bogus"} in snapshots and snapshots[-1] == {"bogus", "xla"}


def test_timing_errors_drop_only_the_failing_run():
    from pallas_kernels import benchmarking as lib

    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory " + "x" * 5000)
        return 0

    errors = {}
    times = lib.interleaved_medians({"ok": (lambda: 0, ()), "bad": (flaky, ())}, repeats=4,
                                    warmup=1, errors=errors)  # fmt: skip
    assert set(times) == {"ok"} and len(times["ok"]) == 4
    err = errors["bad"]
    assert err["error_type"] == "RuntimeError" and err["error_stage"] == "timing"
    assert len(err["error"]) == len("RuntimeError: ") + lib.ERROR_HEAD_CHARS
    assert err["error_tail"] == "x" * lib.ERROR_TAIL_CHARS and err["error_chars"] > 5000
    with pytest.raises(RuntimeError):  # without an errors dict, failures propagate as before
        lib.interleaved_medians({"bad": (flaky, ())}, repeats=1, warmup=0)
    calls["n"] = 0
    times = lib.interleaved_medians({"f": (flaky, ())}, repeats=1, warmup=0, calls=2)
    assert calls["n"] == 2 and len(times["f"]) == 1  # one timing of 2 back-to-back calls
    assert lib.quick_time(lambda: 0, (), 3, calls=2)["quick_rounds"] == 3
