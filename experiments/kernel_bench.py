"""Times paged decode and ragged attention per implementation against dense contiguous attention.

    .venv/bin/python -m experiments.kernel_bench --config=experiments/configs/kernel_bench.py:cpu

For each op and implementation: correctness against an oracle on the same arrays first (the plain
float32 reference at highest matmul precision, or the "xla" path above
``config.reference_bytes_limit``; the oracle itself is spot-checked against float64 numpy on
``oracle_check_seqs`` whole sequences), then ``repeats`` interleaved timing rounds: each round
times every run once, the order alternating forward and backward (A, B, C, C, B, A, ...), so a
baseline is timed right beside what it is compared with. Reported per run: median, min, max and
IQR over rounds (and every round's time); bytes that must move (valid KV + q + out), achieved GB/s,
the fraction of ``--peak_gbps`` and of the measured copy bandwidth (a jitted read + write of the
same K/V pool, timed in the same rounds).

The cost of paging: the ratio to dense contiguous attention (`pallas_kernels.flash_attention`,
same implementation family) on a contiguous copy of the same data, one dense call per distinct
query length over the sequences that have it (same query rows, same causal keys as the paged
call; nothing padded to the longest chunk). Ratios are taken per round and summarised over rounds
(``ratio_to_dense_rounds``: median, min, max, quartiles, IQR, plus the ratio of medians and of
minima); ``ratio_to_dense`` is the median of the per-round ratios. With ``dense_head_major`` the
"xla" family also gets a second dense baseline on ``[B, Hkv, T, D]`` K/V (no per-block transpose).

The CPU target, "paged xla decode <= 1.25x dense contiguous decode" (``config.target_*``), is
judged on that statistic, the median of the per-round paged/dense ratios; the JSON's ``target``
says so and records the ratio's min, max and IQR beside it. Writes JSON with the JAX version,
devices, git revision, load average and config.

A failing implementation (lowering, compile, run, out of memory, wrong numbers) is recorded under
its name (exception type, stage, the message's first 3000 characters and last 1500, the
traceback's end) and the others go on. The JSON is rewritten after every step, with
``complete: false`` until the end, so a run killed by a time limit keeps what it measured. Exits 1
if any implementation errored or failed its check.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import common, provenance
from experiments import kernel_bench_lib as lib

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    str(Path(__file__).resolve().parent / "configs" / "kernel_bench.py") + ":cpu",
    "Benchmark config (experiments/configs/kernel_bench.py:<cpu|smoke|h200>).",
    lock_config=True,
)
_PEAK = flags.DEFINE_float("peak_gbps", None, "Peak memory bandwidth in GB/s (default: config).")
_OUT = flags.DEFINE_string("out", None, "JSON output path (default: config.out).")
common.define_allow_dirty()


def write_record(out: str, record: dict) -> None:
    """Writes ``record`` to ``out`` through the one results writer (`experiments.provenance`:
    code state captured at the start, environment; atomic, so a kill mid-write leaves the
    previous version)."""
    provenance.write_result(out, record)


def _progress(t_start: float):
    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    return say


def run(config: ml_collections.ConfigDict, *, peak_gbps: float | None = None,
        out: str | None = None) -> dict:  # fmt: skip
    """Runs the benchmark ``config`` describes; returns the JSON-able record.

    With ``out``, the record is written there after every step (each implementation's check, each
    op's timing), so a run killed by a time limit still leaves what it measured; ``complete``
    says whether it got to the end.
    """
    unknown = set(config.ops) - {"decode", "ragged", "decode_grid"}
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; known: decode, ragged, decode_grid")
    peak = float(peak_gbps or config.peak_gbps)
    rng = np.random.default_rng(config.seed)
    say = _progress(time.perf_counter())
    record = {
        "study": "kernel_bench",
        "evidence": "constructed",  # random K/V and queries, shapes from the config
        "config": config.to_dict(),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "command": " ".join(sys.argv),
        "peak_gbps": peak,
        "note": config.note,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "complete": False,
    }

    def save():
        if out:
            write_record(out, record)

    save()
    for op in config.ops:
        if op == "decode_grid":  # many shapes, data made on the device (kernel_bench_lib)
            t0 = time.perf_counter()

            def grid_update(rec):
                record["decode_grid"] = rec
                save()

            try:
                record[op] = lib.bench_grid(config, peak_gbps=peak, on_update=grid_update,
                                            progress=say)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                record[op] = {**record.get(op, {"points": []}), **lib.error_record(e, "grid")}
            record[op]["op_s"] = time.perf_counter() - t0
            save()
            continue
        say(f"{op}: building data")
        t0 = time.perf_counter()
        try:
            data = lib.build_decode(config, rng) if op == "decode" else lib.build_ragged(config, rng)
        except Exception as e:  # noqa: BLE001 - the other op may still run
            record[op] = {"impls": {}, "dense": {}, **lib.error_record(e, "build")}
            say(f"{op}: build ERROR {record[op]['error'][:300]}")
            save()
            continue
        build_s = time.perf_counter() - t0
        say(f"{op}: built {data['shape']} in {build_s:.1f}s")
        impls = list(config.decode_impls if op == "decode" else config.ragged_impls)

        def update(rec, op=op, build_s=build_s):
            rec["build_s"] = build_s
            record[op] = rec
            save()

        try:
            record[op] = lib.bench_op(config, op, data, impls, peak_gbps=peak, on_update=update,
                                      progress=say)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a bug outside the per-implementation guards
            partial = record.get(op, {"impls": {}, "dense": {}})
            record[op] = {**partial, **lib.error_record(e, "bench")}
        record[op].update(build_s=build_s, op_s=time.perf_counter() - t0)
        _print_op(op, record[op])
        save()
        for kv in config.kv_cache_dtypes:  # the same data on quantized pools (values + scales)
            _bench_quantized(config, op, kv, data, impls, record, peak=peak, say=say, save=save)
        if config.kv_cache_dtypes:
            record.setdefault("kv_dtypes", {})[op] = lib.kv_summary(record, op,
                                                                    config.kv_cache_dtypes)
            save()
        del data
    target = lib.target_record(record, config)
    if target is not None:
        record["target"] = target
        say(f"target {target['claim']}: ratio {target.get('ratio')} met={target['met']} "
            f"({target['statistic']})")  # fmt: skip
    record["complete"] = True
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    record["load_average_end"] = list(os.getloadavg())  # other work on the machine meanwhile
    save()
    return record


def _bench_quantized(config, op, kv, data, impls, record, *, peak, say, save) -> None:
    """``op`` on ``data`` with K/V quantized to ``kv`` (record key ``op@kv``); no dense baseline."""
    key = lib.kv_key(op, kv)
    t0 = time.perf_counter()
    try:
        qdata = lib.quantize_data(data, config, kv, config.kv_scale_granularity)
    except Exception as e:  # noqa: BLE001
        record[key] = {"impls": {}, "dense": {}, **lib.error_record(e, "build")}
        save()
        return
    record.setdefault("kv_ops", []).append(key)
    qimpls = list(config.kv_impls) or lib.quant_impls(impls)

    def update(rec):
        record[key] = rec
        save()

    try:
        record[key] = lib.bench_op(config, op, qdata, qimpls, peak_gbps=peak, on_update=update,
                                   progress=say, dense=False)  # fmt: skip
    except Exception as e:  # noqa: BLE001
        record[key] = {**record.get(key, {"impls": {}, "dense": {}}), **lib.error_record(e, "bench")}
    record[key].update(kv_cache_dtype=kv, kv_scale_granularity=config.kv_scale_granularity,
                       op_s=time.perf_counter() - t0)  # fmt: skip
    _print_op(key, record[key])
    save()


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _ratio(r: dict) -> str:
    """Per-round ratio summary: median [min, max] IQR."""
    return f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}] iqr {r['iqr']:.3f}"


def _print_op(op: str, rec: dict) -> None:
    print(f"== {op}: {rec.get('shape')}  (oracle: {rec.get('oracle')}, float64 spot check: "
          f"{rec.get('oracle_check', {}).get('correct')})", flush=True)  # fmt: skip
    if "error" in rec:
        print(f"  {op} ERROR {rec['error'][:300]}")
    copy = rec.get("copy", {})
    read = rec.get("read", {})
    if "gbps" in read:
        print(f"  {'read (K+V pool)':<20} median={read['median_ms']:9.3f} ms  {read['gbps']:8.2f} GB/s"
              f" read only ({100 * read['frac_of_datasheet']:5.1f}% datasheet; XLA bytes accessed "
              f"{read.get('xla_bytes_accessed')}, single pass {read.get('single_pass')})")  # fmt: skip
    if "gbps" in copy:
        print(f"  {'copy (K+V pool)':<20} median={copy['median_ms']:9.3f} ms  {copy['gbps']:8.2f} GB/s"
              f" read+write ({100 * copy['fraction_of_peak']:5.1f}% peak)")  # fmt: skip
    for name, r in rec.get("impls", {}).items():
        if "error" in r:
            print(f"  {name:<20} ERROR [{r.get('error_stage')}] {r['error'][:300]}")
            continue
        ratio = r.get("ratio_to_dense_rounds", {})
        print(
            f"  {name:<20} ok={r['correct']!s:<5} err={_fmt(r['max_abs_err'], '.2e')} "
            f"median={r['median_ms']:9.3f} ms (iqr {r['iqr_ms']:.3f})  "
            f"{r['achieved_gbps']:8.2f} GB/s "
            f"({100 * r['fraction_of_peak']:5.1f}% peak"
            + (f", {100 * r['fraction_of_copy']:5.1f}% copy" if "fraction_of_copy" in r else "")
            + (f", {100 * r['frac_of_read_roofline']:5.1f}% read"
               if "frac_of_read_roofline" in r else "")
            + ")"
            + (f"  paged/dense={_ratio(ratio)}" if ratio else "")
            + (f"  paged/dense[{lib.HEAD_MAJOR}]={_ratio(r['ratio_to_dense_head_major_rounds'])}"
               if "ratio_to_dense_head_major_rounds" in r else "")
        )  # fmt: skip
    for name, r in rec.get("dense", {}).items():
        label = f"dense[{name}]"
        if "error" in r:
            print(f"  {label:<20} ERROR [{r.get('error_stage')}] {r['error'][:300]}")
        elif "median_ms" in r:
            print(f"  {label:<20} ok={r['correct']!s:<5} err={_fmt(r['max_abs_err'], '.2e')} "
                  f"median={r['median_ms']:9.3f} ms  iqr={r['iqr_ms']:.3f} ms")  # fmt: skip
    sys.stdout.flush()


def failures(record: dict) -> list[str]:
    """``op:impl`` of every implementation that errored or failed its correctness check."""
    failed = []
    for op in [*record["config"]["ops"], *record.get("kv_ops", [])]:
        rec = record.get(op, {})
        if "error" in rec:
            failed.append(f"{op}:*")
        for p in rec.get("points", []):  # decode_grid
            where = f"{op}[{p['dtype']},{p['context']},{p['batch']}]"
            if "error" in p:
                failed.append(f"{where}:*")
            failed += [f"{where}:{name}" for name, r in p.get("impls", {}).items()
                       if "error" in r or not r.get("correct", False)]  # fmt: skip
        failed += [f"{op}:{name}" for name, r in rec.get("impls", {}).items()
                   if "error" in r or not r.get("correct", False)]  # fmt: skip
    return failed


def main(argv) -> None:
    del argv
    common.begin_run("kernel_bench")
    config = _CONFIG.value
    out = _OUT.value or config.out
    if not out:  # nothing under version control by default: results/kernel_bench/<UTC time>/
        from experiments.common import results_dir

        out = str(results_dir("kernel_bench") / "kernel_bench.json")
    record = run(config, peak_gbps=_PEAK.value, out=out)
    if out:
        print(f"wrote {out}")
    failed = failures(record)
    if failed:
        print(f"FAILED correctness or errored: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
