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
    assert record["evidence"] == "constructed" and record["provenance"]["git_commit"]
    for key in ("jax_version", "devices", "config", "peak_gbps"):
        assert key in record
    assert record["complete"] is True
    for op in ("decode", "ragged"):
        impls = record[op]["impls"]
        assert set(impls) == set(record["config"][f"{op}_impls"])
        assert record[op]["oracle_check"]["correct"] and record[op]["oracle_check"]["seqs"]
        assert record[op]["copy"]["gbps"] > 0
        read = record[op]["read"]  # the read-only roofline: one pass over the pool by XLA's count
        assert read["gbps"] > 0 and read["single_pass"] and read["frac_of_datasheet"] > 0
        assert read["pool_bytes"] <= read["xla_bytes_accessed"] <= 1.01 * read["pool_bytes"] + 4096
        assert record[op]["datasheet_gbps"] == record["peak_gbps"]  # smoke: datasheet_gbps = 0
        for name, r in impls.items():
            assert r["correct"], (op, name, r)
            assert r["median_ms"] > 0 and r["quick_median_ms"] > 0
            assert r["achieved_gbps"] > 0 and r["ratio_to_dense"] > 0
            assert r["fraction_of_copy"] > 0 and r["frac_of_copy"] == r["fraction_of_copy"]
            assert r["frac_of_read_roofline"] == r["achieved_gbps"] / read["gbps"]
            assert r["frac_of_datasheet"] == r["achieved_gbps"] / record["peak_gbps"]
        assert record[op]["dense"]["xla_head_major"]["correct"]
        assert impls["xla"]["ratio_to_dense_head_major"] > 0
        assert record[op]["bytes"] > 0
        for r in impls.values():  # the headline ratio is the median of per-round ratios
            rr = r["ratio_to_dense_rounds"]
            assert r["ratio_to_dense"] == rr["median"] and rr["rounds"] == r["rounds"]
            assert rr["min"] <= rr["q1"] <= rr["median"] <= rr["q3"] <= rr["max"]
            assert rr["iqr"] == rr["q3"] - rr["q1"]
            assert len(r["round_ms"]) == r["rounds"]
            assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        order = record[op]["timing_order"]  # each ratio's two sides are timed side by side
        xla_at = order.index("xla")
        assert order.index("dense:xla") == xla_at - 1
        assert order.index("dense:xla_head_major") == xla_at + 1
    _check_kv_dtypes(record)
    grid = record["decode_grid"]  # one tiny point: every grid impl checked, timed, compared
    (point,) = grid["points"]
    assert (point["dtype"], point["context"], point["batch"]) == ("float32", 40, 3)
    assert point["k_splits"] == 2 and point["read"]["gbps"] > 0 and point["copy"]["gbps"] > 0
    assert set(point["impls"]) == set(record["config"]["decode_grid"]["impls"])
    for name, r in point["impls"].items():
        assert r["correct"] and r["median_ms"] > 0 and r["frac_of_read_roofline"] > 0, (name, r)
        assert r["speedup_vs_jax_gpu_interpret"] > 0 and r["frac_of_datasheet"] > 0
    assert point["impls"]["xla"]["max_abs_diff_vs_interpret_gpu"] < 1e-4
    target = record["target"]
    assert target["statistic"].startswith("median over the timing rounds of the per-round ratio")
    assert target["ratio"] == record["decode"]["impls"]["xla"]["ratio_to_dense"]
    assert target["met"] == (target["ratio"] <= 1.25) and target["rounds"] >= 1


def _check_kv_dtypes(record):
    """The KV dtype factor: each op again on int8 / fp8 pages, bytes at their own exact count."""
    cfg = record["config"]
    assert cfg["kv_cache_dtypes"] == ["int8", "fp8_e4m3"] and cfg["kv_scale_granularity"] == "page"
    hkv, d, hq = cfg["heads"]["num_kv_heads"], cfg["heads"]["head_dim"], cfg["heads"]["num_q_heads"]
    # smoke shapes: decode 3 x 40 keys (5 pages of 8 each); ragged: one 24-key prefill chunk of 8
    # rows, two 40-key decodes, one 40-key verify of 4 rows; pools of 18 and 23 pages (spares incl.).
    tokens_pages_rows_pool = {"decode": (120, 15, 3, 18), "ragged": (144, 18, 14, 23)}
    assert record["kv_ops"] == [f"{op}@{kv}" for op in ("decode", "ragged")
                                for kv in cfg["kv_cache_dtypes"]]  # fmt: skip
    for op, (tokens, pages, rows, pool_pages) in tokens_pages_rows_pool.items():
        q_bytes = 2 * rows * hq * d * 4  # q + out, float32
        assert record[op]["bytes"] == 2 * hkv * tokens * d * 4 + q_bytes
        for kv in cfg["kv_cache_dtypes"]:
            rec = record[f"{op}@{kv}"]
            assert rec["kv_cache_dtype"] == kv and not rec["dense"]
            assert rec["bytes"] == 2 * hkv * (tokens * d * 1 + pages * 4) + q_bytes  # 1-byte values
            pool = 2 * hkv * pool_pages * (8 * d * 1 + 4)  # values + one f32 scale per page, head
            assert rec["read"]["pool_bytes"] == pool and rec["copy"]["pool_bytes"] == pool
            if kv == "int8":  # XLA CPU reads int8 in one pass; fp8 it converts first (recorded)
                assert rec["read"]["single_pass"]
            assert rec["oracle"] == "reference" and rec["oracle_check"]["correct"]
            assert set(rec["impls"]) == set(cfg["kv_impls"])
            for name, r in rec["impls"].items():
                assert r["correct"] and r["median_ms"] > 0, (op, kv, name, r)
                assert r["frac_of_read_roofline"] == r["achieved_gbps"] / rec["read"]["gbps"]
                row = record["kv_dtypes"][op][name][kv]
                assert row["bytes"] == rec["bytes"] and row["median_ms"] == r["median_ms"]
                assert row["bytes_vs_auto"] == rec["bytes"] / record[op]["bytes"] < 0.5
                assert row["time_vs_auto"] == r["median_ms"] / record[op]["impls"][name]["median_ms"]


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

    from experiments import kernel_bench_lib as lib
    from experiments.configs import kernel_bench

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


def test_ragged_dense_baseline_does_the_paged_work():
    """One dense call per distinct query length, over the sequences that have it: the same query
    rows (no padding to the longest chunk) and each token row mapped back to its place."""
    import numpy as np

    from experiments import kernel_bench_lib as lib
    from experiments.configs import kernel_bench

    config = kernel_bench.get_config("smoke")
    data = lib.build_ragged(config, np.random.default_rng(0))
    seqs = lib.ragged_seqs(config.ragged)
    groups = [data["dense_args"][i : i + 4] for i in range(0, len(data["dense_args"]), 4)]
    assert sorted(q.shape[1] for q, *_ in groups) == sorted({q_len for _, q_len in seqs})
    assert sum(q.shape[0] * q.shape[1] for q, *_ in groups) == sum(n for _, n in seqs)
    rows = np.concatenate(data["dense_rows"])
    np.testing.assert_array_equal(np.sort(rows), data["live_rows"])
    q = data["args"][0]
    np.testing.assert_array_equal(np.concatenate([g[0].reshape(-1, *q.shape[1:]) for g in groups]),
                                  q[rows])  # fmt: skip


def test_per_round_ratios_and_alternating_order():
    from experiments import kernel_bench_lib as lib

    seen = []
    runs = {name: (lambda name=name: seen.append(name), ()) for name in "abc"}
    times = lib.interleaved_rounds(runs, repeats=3, warmup=0)
    assert "".join(seen) == "abccbaabc" and all(len(ts) == 3 for ts in times.values())
    r = lib.per_round_ratios([2.0, 4.0, 9.0, 1.0], [1.0, 2.0, 3.0, 1.0])
    assert r["median"] == 2.0 and r["min"] == 1.0 and r["max"] == 3.0 and r["rounds"] == 4
    assert r["iqr"] == r["q3"] - r["q1"] and r["ratio_of_medians"] == 3.0 / 1.5


def test_timing_errors_drop_only_the_failing_run():
    from experiments import kernel_bench_lib as lib

    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory " + "x" * 5000)
        return 0

    errors = {}
    times = lib.interleaved_rounds({"ok": (lambda: 0, ()), "bad": (flaky, ())}, repeats=4,
                                    warmup=1, errors=errors)  # fmt: skip
    assert set(times) == {"ok"} and len(times["ok"]) == 4
    err = errors["bad"]
    assert err["error_type"] == "RuntimeError" and err["error_stage"] == "timing"
    assert len(err["error"]) == len("RuntimeError: ") + lib.ERROR_HEAD_CHARS
    assert err["error_tail"] == "x" * lib.ERROR_TAIL_CHARS and err["error_chars"] > 5000
    with pytest.raises(RuntimeError):  # without an errors dict, failures propagate as before
        lib.interleaved_rounds({"bad": (flaky, ())}, repeats=1, warmup=0)
    calls["n"] = 0
    times = lib.interleaved_rounds({"f": (flaky, ())}, repeats=1, warmup=0, calls=2)
    assert calls["n"] == 2 and len(times["f"]) == 1  # one timing of 2 back-to-back calls
    assert lib.quick_time(lambda: 0, (), 3, calls=2)["quick_rounds"] == 3
