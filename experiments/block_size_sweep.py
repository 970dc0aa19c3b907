"""Block-size sweep: position utilization, tail waste, block-table bytes, step time, goodput.

For each block size ``B`` on one constructed ShareGPT-like workload (lengths scaled to
``max_model_len``), with the same KV pool in positions (so in bytes) for every ``B``:

* **formulas** on the workload's final lengths ``n_i = prompt_i + output_i``: position utilization
  ``sum(n_i) / sum(B * ceil(n_i / B))``, tail waste ``sum(B * ceil(n_i / B) - n_i)`` in positions
  and bytes, and block-table bytes ``max_num_seqs * ceil(max_model_len / B) * 4`` (the engine's
  dense i32 table);
* **engine ledger** (timed block sizes only): the ledger sample with the most in-use bytes during
  the serving run ("at peak": position utilization and tail-fragmentation bytes of sequences caught
  mid-generation), and the ledger with the pool full of decoding sequences, beside the formulas on
  exactly those sequences' lengths (the two must agree);
* **decode step time**: the median engine step (host + device) with the pool full of decoding
  sequences whose lengths come from the workload (mid-generation: ``prompt + output // 2``), as many
  as fit in the pool and ``max_num_seqs``, so a large ``B`` runs fewer of them;
* **throughput at SLO**: output tokens/s and goodput (requests/s meeting the TTFT and TPOT SLO) of a
  short real-time run of the workload through `experiments.serving.run_arm`, started cold each
  round (the engine's prefix cache emptied: no hit carries over from the previous round's same
  prompts) and recorded in ``replay.json`` (``python -m experiments.replay --from=<dir>``).

Every timed ``B`` has its own engine, compiled before any timing; then ``repeats`` rounds run every
``B`` in turn (the order alternates between rounds), so a drift in machine load touches all of them.
Serving metrics are means over rounds, the decode step time the median over every timed step of
every round. Timings are from shared CPUs and noisy; compare block sizes within one run. Evidence:
constructed by default; a trace (``workload.trace``) carries its own label.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from experiments import common, fragmentation, plots, serving
from experiments.replay import replay_command
from paged import EngineConfig, SamplingParams, accounting
from paged.workload.workload import Workload, check_same_evidence

_TABLE_ENTRY_BYTES = 4  # the engine's block table holds i32 page indices


def check_config(c) -> tuple[list[int], list[int]]:
    """Returns ``(block_sizes, timed_block_sizes)``; raises ValueError naming a bad value."""
    sizes = list(c.block_sizes)
    if (not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes)
            or len(set(sizes)) != len(sizes)):
        raise ValueError(f"block_sizes={tuple(c.block_sizes)} must be distinct positive integers")
    timed = list(c.timed_block_sizes) or sizes
    missing = [b for b in timed if b not in sizes]
    if missing:
        raise ValueError(f"timed_block_sizes {missing} are not in block_sizes={tuple(sizes)}")
    if c.pool_positions < c.engine.max_model_len:
        raise ValueError(f"pool_positions={c.pool_positions} must hold one request of "
                         f"engine.max_model_len={c.engine.max_model_len}")
    if c.repeats < 1:
        raise ValueError(f"repeats={c.repeats} must be >= 1")
    if c.decode_steps < 1 or c.decode_warmup_steps < 0:
        raise ValueError(f"decode_steps={c.decode_steps} must be >= 1 and "
                         f"decode_warmup_steps={c.decode_warmup_steps} >= 0")
    return sorted(sizes), sorted(timed)


def check(c) -> dict:
    """Checks every setting; builds the workload and each timed block size's EngineConfig."""
    serving.check_serving(c)
    common.check_unset(c.engine, ["block_size"], "block_sizes")
    common.check_unset(c.engine, ["num_blocks"], "pool_positions")
    sizes, timed = check_config(c)
    engines = {b: engine_config(c, b) for b in timed}
    workload = serving.build_workload(c.workload, c.engine.max_model_len)
    check_same_evidence([workload])
    return {"sizes": sizes, "timed": timed, "engines": engines, "workload": workload}


def engine_config(c, block_size: int) -> EngineConfig:
    num_blocks = -(-c.pool_positions // block_size) + 1  # + the null page
    return common.make_engine_config(c.engine, model=c.model, block_size=block_size,
                                     num_blocks=num_blocks)


# --- formulas ----------------------------------------------------------------------------------
def formula_metrics(lengths, block_size: int, bytes_per_token: int) -> dict:
    """Position metrics of ``lengths`` stored in blocks of ``block_size`` (exact integers)."""
    alloc = sum(accounting.allocated_positions(int(n), block_size) for n in lengths)
    waste = alloc - int(sum(lengths))
    return {"num_sequences": len(lengths), "valid_positions": int(sum(lengths)),
            "allocated_positions": alloc,
            "position_utilization": accounting.position_utilization(
                [int(n) for n in lengths], block_size=block_size),
            "tail_waste_positions": waste, "tail_waste_per_seq": waste / len(lengths),
            "tail_waste_bytes": waste * bytes_per_token}


def kv_bytes_by_dtype(formula: dict, block_size: int, spec: accounting.ModelSpec) -> dict:
    """The allocated bytes of :func:`formula_metrics` in each of ``fragmentation.KV_DTYPES`` (model
    dtype, int8, int8 with page scales, fp8; exact, scales included), by fragmentation's helper."""
    layout = {"layout": "paged", "block_size": block_size, "max_len": 0,
              "allocated_positions": formula["allocated_positions"],
              "valid_positions": formula["valid_positions"],
              "wasted_positions": formula["tail_waste_positions"]}
    return fragmentation.kv_bytes_rows([layout], spec)[0]["allocated_bytes_by_kv_dtype"]


def ledger_position_metrics(categories: dict) -> dict:
    """Utilization and tail waste of one ledger snapshot's in-use blocks (bytes per category)."""
    filled = categories["effective_kv"] + categories["shared"]
    in_use = filled + categories["tail_fragmentation"]
    return {"in_use_bytes": in_use, "filled_bytes": filled,
            "tail_fragmentation_bytes": categories["tail_fragmentation"],
            "position_utilization": filled / in_use if in_use else None}


def peak_ledger(trace: dict) -> dict | None:
    """The trace sample with the most in-use bytes (effective + shared + tail), or None."""
    ledger = trace.get("ledger") or {}
    if not ledger or not trace.get("time_s"):
        return None
    in_use = (np.asarray(ledger["effective_kv"]) + np.asarray(ledger["shared"])
              + np.asarray(ledger["tail_fragmentation"]))
    i = int(np.argmax(in_use))
    cats = {k: int(v[i]) for k, v in ledger.items()}
    return {"time_s": float(trace["time_s"][i]), "num_samples": len(trace["time_s"]),
            **ledger_position_metrics(cats)}


# --- decode step time with the pool full -------------------------------------------------------
def prefill_growth(prompt_lens: list[int], max_tokens: int, max_seqs: int) -> list[int]:
    """Tokens each decoder appends while the later prompts are still prefilling.

    A small model of the engine's decode-first chunked prefill (decoders first, then partial
    prefills, then FIFO admission, all within the step's token and sequence budgets), used only to
    size the pool fill; the measurement reads the real lengths back from the engine.
    """
    remaining = list(prompt_lens)
    done_at: list[int | None] = [None] * len(prompt_lens)
    admitted, step = 0, 0
    while any(d is None for d in done_at):
        step += 1
        tokens, seqs = max_tokens, max_seqs
        decoding = [i for i in range(admitted) if done_at[i] is not None]
        prefilling = [i for i in range(admitted) if done_at[i] is None]
        for i in decoding + prefilling:
            if not tokens or not seqs:
                break
            if i in prefilling:
                n = min(remaining[i], tokens)
                remaining[i] -= n
                tokens -= n
                if not remaining[i]:
                    done_at[i] = step
            else:
                tokens -= 1
            seqs -= 1
        while admitted < len(prompt_lens) and tokens and seqs:
            i = admitted
            admitted += 1
            n = min(remaining[i], tokens)
            remaining[i] -= n
            tokens, seqs = tokens - n, seqs - 1
            if not remaining[i]:
                done_at[i] = step
    last = max(done_at)
    return [last - d for d in done_at]


def fill_lengths(workload: Workload, c, block_size: int, num_positions: int) -> list[int]:
    """Prompt lengths of the timed decoders: mid-generation lengths (``prompt + output // 2``) of
    the workload's requests in order (cycling), as many as fit in the pool at their length at the
    end of the timing (prefill-phase growth included) and in ``max_num_seqs``."""
    extra = c.decode_warmup_steps + c.decode_steps + 1
    mids = [max(1, min(r.prompt_len + r.output_len // 2, c.engine.max_model_len // 2))
            for r in workload.requests]
    out: list[int] = []
    while len(out) < c.engine.max_num_seqs:
        cand = out + [mids[len(out) % len(mids)]]
        growth = prefill_growth(cand, c.engine.max_num_batched_tokens, c.engine.max_num_seqs)
        final = [n + g + extra for n, g in zip(cand, growth, strict=True)]
        if max(final) > c.engine.max_model_len or sum(
                accounting.allocated_positions(f, block_size) for f in final) > num_positions:
            break
        out = cand
    return out


def time_decode(engine, prompt_lens: list[int], c, bytes_per_token: int) -> dict:
    """Fills the idle engine with decoders of ``prompt_lens`` tokens and times decode steps."""
    if engine.has_unfinished_requests():
        raise RuntimeError("time_decode needs an idle engine")
    preempt0 = engine.scheduler.num_preemptions
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=c.engine.max_model_len, temperature=0.0, ignore_eos=True)
    ids = [f"decode-{i}" for i in range(len(prompt_lens))]
    for rid, n in zip(ids, prompt_lens, strict=True):
        engine.add_request(rid, [256] + rng.integers(0, 256, n - 1).tolist(), params)
    prefill_steps = 0
    while engine.scheduler.waiting or any(not s.is_decoding for s in engine.scheduler.running):
        engine.step()
        prefill_steps += 1
    for _ in range(c.decode_warmup_steps):
        engine.step()
    stats = engine.kv_stats()
    bm = engine.block_manager
    held = [bm.num_tokens(s.seq_id) for s in engine.scheduler.running]  # KV positions held now
    full = ledger_position_metrics(stats["ledger"]["categories"])
    steps = []
    for _ in range(c.decode_steps):
        engine.step()
        t = engine.last_timing
        steps.append((t.host + t.device, t.device, t.num_seqs))
    for rid in ids:
        engine.abort(rid)
    engine.step()  # reports the aborted requests; leaves the engine idle
    med = float(np.median([s[0] for s in steps]))
    return {"num_seqs": len(prompt_lens), "stepped_seqs": sorted({s[2] for s in steps}),
            "steps": len(steps), "prefill_steps": prefill_steps, "median_step_ms": 1e3 * med,
            "median_device_ms": 1e3 * float(np.median([s[1] for s in steps])),
            "decode_tokens_per_s": len(prompt_lens) / med,
            "step_ms": [1e3 * s[0] for s in steps], "device_ms": [1e3 * s[1] for s in steps],
            "preemptions": engine.scheduler.num_preemptions - preempt0,
            "pool_fill": stats["num_used_blocks"] / (stats["num_blocks"] - 1),
            "pool_full_ledger": {**full, "used_blocks": stats["num_used_blocks"],
                                 "num_blocks": stats["num_blocks"]},
            "pool_full_formula": formula_metrics(held, engine.page_size, bytes_per_token)}


# --- one block size ----------------------------------------------------------------------------
def measure_round(engine, c, workload: Workload, bytes_per_token: int, replays=None,
                  round_: int = 0) -> dict:
    """One serving run of the workload, then decode steps with the pool full, on an idle engine.
    The engine is reused across rounds: the run starts cold (``serving.start_cold``: no prefix
    hit carries over from the previous round's same prompts), so it replays; ``replays`` gets
    its record (arm ``B=<B>#<round>``)."""
    B = engine.page_size
    serving.start_cold(engine)
    preempt0 = engine.scheduler.num_preemptions
    arm = serving.run_arm(f"B={B}#{round_}", engine, workload, ttft_slo_ms=c.ttft_slo_ms,
                          tpot_slo_ms=c.tpot_slo_ms, max_wall_s=c.max_wall_s, progress="tty",
                          model_name=c.model)
    if replays is not None:
        replays.append(arm.replay)
    serve = {k: arm.summary.get(k) for k in _SERVING_KEYS}
    serve["engine_preemptions"] = engine.scheduler.num_preemptions - preempt0  # this run only
    serve["wall_s"] = arm.wall_s
    pool = (engine.config.num_blocks - 1) * B
    decode = time_decode(engine, fill_lengths(workload, c, B, pool), c, bytes_per_token)
    return {"serving": serve, "ledger_at_peak": peak_ledger(arm.trace), "decode": decode}


_SERVING_KEYS = ("num_requests", "completed", "num_rejected", "num_aborted", "num_timeout",
                 "output_throughput", "request_throughput", "request_goodput", "mean_ttft_ms",
                 "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")
_SERVING_MEANS = ("output_throughput", "request_throughput", "request_goodput", "mean_ttft_ms",
                  "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "wall_s")


def aggregate(rounds: list[dict]) -> dict:
    """Serving metrics: mean over rounds (counts: summed); decode: median over every timed step
    of every round; ledger at peak: the round whose peak held the most bytes."""
    serve = {}
    for k in rounds[0]["serving"]:
        vals = [r["serving"][k] for r in rounds]
        if k in _SERVING_MEANS:
            vals = [v for v in vals if v is not None]
            serve[k] = float(np.mean(vals)) if vals else None
        else:
            serve[k] = sum(vals)
    steps = [t for r in rounds for t in r["decode"]["step_ms"]]
    dev = [t for r in rounds for t in r["decode"]["device_ms"]]
    d0 = rounds[0]["decode"]
    med = float(np.median(steps))
    decode = {"num_seqs": d0["num_seqs"], "steps": len(steps), "median_step_ms": med,
              "median_device_ms": float(np.median(dev)),
              "decode_tokens_per_s": d0["num_seqs"] / (med / 1e3),
              "stepped_seqs": sorted({n for r in rounds for n in r["decode"]["stepped_seqs"]}),
              "preemptions": sum(r["decode"]["preemptions"] for r in rounds),
              "pool_fill": d0["pool_fill"], "pool_full_ledger": d0["pool_full_ledger"],
              "pool_full_formula": d0["pool_full_formula"]}
    peaks = [r["ledger_at_peak"] for r in rounds if r["ledger_at_peak"]]
    peak = max(peaks, key=lambda p: p["in_use_bytes"], default=None)
    return {"serving": serve, "decode": decode, "ledger_at_peak": peak}


def run(c, out_dir: Path, plan: dict | None = None) -> dict:
    plan = plan or check(c)
    sizes, timed, workload = plan["sizes"], plan["timed"], plan["workload"]
    model = common.load_model(c.model)
    spec = accounting.ModelSpec.from_model_config(model[0], dtype=plan["engines"][timed[0]].dtype)
    bpt = spec.bytes_per_token
    lengths = [r.prompt_len + r.output_len for r in workload.requests]
    print(f"workload: {len(workload)} requests, evidence={workload.evidence}, mean final length "
          f"{np.mean(lengths):.1f}, max {max(lengths)}; {bpt} KV bytes/token")
    rows = []
    engines, built = {}, {}
    for b in timed:  # compile everything first, so the timed rounds run back to back
        t0 = time.perf_counter()
        engines[b] = serving.build_engine(plan["engines"][b], model)
        built[b] = time.perf_counter() - t0
    rounds: dict[int, list[dict]] = {b: [] for b in timed}
    replays: list[dict] = []
    # Engines with one model and attention impl share one jitted step, so its trace count is global.
    traces0 = engines[timed[0]].num_compilations
    with common.Progress(c.repeats * len(timed), "[block_size_sweep]", unit="round") as bar:
        for i in range(c.repeats):  # alternate the order so a drift in load hits every B alike
            for b in (timed if i % 2 == 0 else timed[::-1]):
                rounds[b].append(measure_round(engines[b], c, workload, bpt, replays, i))
                bar.update()
    compiled_while_timing = engines[timed[0]].num_compilations - traces0
    for b in sizes:
        row = {"block_size": b,
               "formula": formula_metrics(lengths, b, bpt),
               "block_table_bytes": accounting.block_table_bytes(
                   c.engine.max_num_seqs, -(-c.engine.max_model_len // b), _TABLE_ENTRY_BYTES),
               "pool_positions": (-(-c.pool_positions // b)) * b}
        row["kv_bytes_by_dtype"] = kv_bytes_by_dtype(row["formula"], b, spec)
        if b in timed:
            e = engines[b]
            row.update({"engine_config": dataclasses.asdict(e.config), "warmup_compile_s": built[b],
                        **aggregate(rounds[b]), "rounds": rounds[b]})
        rows.append(row)
        print(format_row(row), flush=True)
        print(f"  B={b} allocated KV bytes by dtype: " + ", ".join(
            f"{k} {v / 2**20:.2f} MiB" for k, v in row["kv_bytes_by_dtype"].items()), flush=True)
    print(format_table(rows, workload.evidence))
    payload = {
        "study": "block_size_sweep", "evidence": workload.evidence, "config": c.to_dict(),
        "timed_block_sizes": timed, "compilations_during_timing": compiled_while_timing,
        "timed_note": ("engine metrics (serving run, ledger, decode step time) only for "
                       "timed_block_sizes; formulas for every block size"),
        "model_spec": dataclasses.asdict(spec), "kv_bytes_per_token": bpt,
        "reservation_baseline": {"max_len": c.engine.max_model_len,
                                 "position_utilization": accounting.position_utilization(
                                     lengths, max_len=c.engine.max_model_len)},
        "workload": {"name": workload.name, "seed": workload.seed, "meta": workload.meta,
                     "summary": workload.summary()},
        "definitions": {
            "formula": "final lengths n_i = prompt_len + output_len of every workload request",
            "ledger_at_peak": "engine ledger sample (every 50 ms of the serving run) with the most "
                              "in-use bytes; utilization = (effective_kv + shared) / in-use",
            "decode": "pool full of decoders (mid-generation workload lengths, as many as fit in "
                      "the pool and max_num_seqs); median step = host + device, over every timed "
                      "step of every round",
            "serving": "run_arm on the workload in real time; mean over rounds (counts summed)",
            "block_table_bytes": "max_num_seqs * ceil(max_model_len / B) * 4 (i32)",
            "goodput": "finished requests/s meeting TTFT and TPOT SLO"},
        "results": rows, "provenance": common.provenance()}
    json_path = common.write_result(out_dir / "block_size_sweep.json", payload)
    if c.plots:
        plot(rows, out_dir / "block_size_sweep.png", c, workload.evidence)
    print(f"wrote {json_path}" + (" and block_size_sweep.png" if c.plots else ""))
    if serving.write_replay_records(out_dir / "replay.json", replays):
        print(f"replay: {replay_command(out_dir)}")
    return payload


# --- report ------------------------------------------------------------------------------------
def _fmt(v, f):
    return "-" if v is None else f.format(v)


def format_row(r: dict) -> str:
    f = r["formula"]
    line = (f"B={r['block_size']:4d}  util {100 * f['position_utilization']:6.2f}%  tail "
            f"{f['tail_waste_per_seq']:6.1f} pos/seq  table {r['block_table_bytes']:6d} B")
    if "decode" in r:
        d, s = r["decode"], r["serving"]
        line += (f"  step {d['median_step_ms']:6.2f} ms x{d['num_seqs']}  out "
                 f"{s['output_throughput']:6.1f} tok/s  goodput "
                 f"{_fmt(s['request_goodput'], '{:.2f}')}")
    return line


def format_table(rows: list[dict], evidence: str = "constructed") -> str:
    head = (f"{'B':>5s} {'util%':>7s} {'util% ledger':>12s} {'tail pos':>9s} {'tail KiB':>9s} "
            f"{'table B':>8s} {'decoders':>8s} {'step ms':>8s} {'dec tok/s':>9s} {'out tok/s':>9s} "
            f"{'goodput':>8s} {'preempt':>7s}")
    lines = [(f"block-size sweep (evidence: {evidence}; formulas on final lengths, "
              "ledger at the serving peak)"), head]
    for r in rows:
        f = r["formula"]
        peak = r.get("ledger_at_peak") or {}
        d, s = r.get("decode", {}), r.get("serving", {})
        pu = peak.get("position_utilization")
        lines.append(
            f"{r['block_size']:5d} {100 * f['position_utilization']:7.2f} "
            f"{_fmt(None if pu is None else 100 * pu, '{:.2f}'):>12s} "
            f"{f['tail_waste_positions']:9d} {f['tail_waste_bytes'] / 1024:9.0f} "
            f"{r['block_table_bytes']:8d} {_fmt(d.get('num_seqs'), '{}'):>8s} "
            f"{_fmt(d.get('median_step_ms'), '{:.2f}'):>8s} "
            f"{_fmt(d.get('decode_tokens_per_s'), '{:.0f}'):>9s} "
            f"{_fmt(s.get('output_throughput'), '{:.1f}'):>9s} "
            f"{_fmt(s.get('request_goodput'), '{:.2f}'):>8s} "
            f"{_fmt(s.get('engine_preemptions'), '{}'):>7s}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, c, evidence: str = "constructed") -> Path:
    """Three panels against B: utilization and tail waste; block-table bytes; step time and
    throughput at SLO."""
    plt = plots.pyplot()
    bs = [r["block_size"] for r in rows]
    timed = [r for r in rows if "decode" in r]
    tb = [r["block_size"] for r in timed]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))

    ax = axes[0]
    ax.plot(bs, [100 * r["formula"]["position_utilization"] for r in rows], "o-",
            label="utilization (formula, final lengths)")
    peaks = [(r["block_size"], r["ledger_at_peak"]["position_utilization"]) for r in timed
             if r.get("ledger_at_peak") and r["ledger_at_peak"]["position_utilization"] is not None]
    if peaks:
        ax.plot([p[0] for p in peaks], [100 * p[1] for p in peaks], "s--",
                label="utilization (ledger, serving peak)")
    ax.set_ylabel("position utilization (%)")
    ax2 = ax.twinx()
    ax2.plot(bs, [r["formula"]["tail_waste_bytes"] / 2**20 for r in rows], "^:", color="C3",
             label="tail waste (formula)")
    ax2.set_ylabel("tail waste (MiB, all requests)", color="C3")
    ax.set_title("utilization and tail waste")
    _legend(ax, ax2)

    ax = axes[1]
    ax.plot(bs, [r["block_table_bytes"] for r in rows], "o-")
    ax.set_yscale("log")
    ax.set_ylabel("block-table bytes")
    ax.set_title(f"block table: {c.engine.max_num_seqs} x ceil({c.engine.max_model_len}/B) x i32")

    ax = axes[2]
    if timed:
        ax.plot(tb, [r["decode"]["median_step_ms"] for r in timed], "o-",
                label="decode step (pool full; n = decoders that fit)")
        for r in timed:
            ax.annotate(f"n={r['decode']['num_seqs']}",
                        (r["block_size"], r["decode"]["median_step_ms"]),
                        textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")
        ax.set_ylabel("median decode step (ms)")
        ax2 = ax.twinx()
        ax2.plot(tb, [r["serving"]["output_throughput"] for r in timed], "s--", color="C2",
                 label="output tok/s (serving run)")
        ax2.plot(tb, [r["decode"]["decode_tokens_per_s"] for r in timed], "v:", color="C4",
                 label="decode tok/s (pool full)")
        gp = [r["serving"]["request_goodput"] or 0.0 for r in timed]
        ax2.plot(tb, [g * 100 for g in gp], "^-.", color="C3", label="goodput x100 (req/s)")
        ax2.set_ylabel("tokens/s  (goodput x100)")
        _legend(ax, ax2)
    ax.set_title(f"step time and throughput at SLO (TTFT {c.ttft_slo_ms:.0f} ms, "
                 f"TPOT {c.tpot_slo_ms:.0f} ms)", fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size B (positions)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"block-size sweep (evidence: {evidence})", fontsize=10)
    plots.save(fig, path)
    return path


def _legend(ax, ax2):
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="best")


def main(c, plan):
    run(c, common.output_dir(c, "block_size_sweep"), plan)


if __name__ == "__main__":
    common.run("block_size_sweep", main, check)
