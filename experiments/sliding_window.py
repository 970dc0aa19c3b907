"""Sliding windows at the same pool bytes: KV blocks per sequence, admitted concurrency, throughput.

Arms: the model with full attention, and the same weights with every layer sliding at a window
``W = fraction * max_model_len`` (one arm per ``config.window_fractions``). Every arm gets the same
``num_blocks`` (a window changes no block's size, so the same pool bytes) and serves the same
long-output requests offline: all added at t = 0, greedy, ``ignore_eos``, each writing
``output_len`` tokens after a ``prompt_len``-token prompt.

With every layer sliding the engine recycles a block once it lies wholly behind every future
query's window (`paged.kv.blocks.window`), so a sequence holds at most ``ceil(W / B) + 1`` blocks once
its prompt is behind it (one more with ``async_scheduling``), where full attention holds
``ceil(len / B)`` and grows to ``ceil(max_model_len / B)``. Measured per arm, read from the engine
after every step:

* **blocks per sequence over time**: the non-null entries of each device-resident sequence's
  block table (mean and max over the running sequences of that step; plotted), and
  ``kv_stats()["max_blocks_per_sequence"]``, the most any sequence held at once (a sequence
  preempted by recompute comes back with its generated tokens as prompt, and a prompt's blocks
  are all taken at admission, so this can pass ``ceil(W / B) + 1`` in an arm that preempts);
* ``recycled_blocks`` (blocks freed because they left the window) and the ledger's
  ``recycled_bytes``;
* **admitted concurrency**: the peak number of device-resident running sequences over steps, and
  their mean and median over the steps that run any (offline, every arm admits all requests'
  short prompts at t = 0, so the peak is the request count; the mean and median say how many the
  pool keeps running once they grow), and **preemptions** (``kv_stats()["num_preemptions"]``);
* **throughput** of the offline run: output tokens / wall seconds of the run (compilation excluded
  when ``config.warmup``), engine steps.

Not measured here (offline, no arrival process): capacity at a latency SLO. The same arms at the
same pool are swept over request rates on the CPU engine by `experiments.sliding_window_capacity`
(results in ``experiments/results/sliding_window/capacity/``), and the fleet what-if for a
Mistral-7B-shaped model on a simulated H200 (`paged.sim` recycles blocks behind the window with the
real `paged.kv.blocks.window` and its roofline reads only in-window KV) is the fleet study's
``window`` and ``window_fractions`` variants (`experiments/fleet_whatifs.py`; results in
``experiments/results/sliding_window_fleet/``).

Writes ``sliding_window.json`` (per arm: the summary and the per-step trace) and
``sliding_window.png`` (blocks per running sequence and running sequences against the step).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from pathlib import Path

from experiments import common, plots
from paged import Engine, SamplingParams
from paged.config.support import check_supported
from paged.kv.paging import NULL_PAGE
from paged.kv.spec import recycling_window
from paged.models.config import LlamaConfig
from paged.workload.workload import Workload, make_workload


# --- arms -------------------------------------------------------------------------------------
def arm_windows(c) -> list[tuple[str, int | None]]:
    """``(name, W)`` per arm: full attention first, then one per window fraction."""
    if not c.window_fractions:
        raise ValueError("window_fractions=() names no sliding arm")
    arms: list[tuple[str, int | None]] = [("full", None)]
    L = c.engine.max_model_len
    for i, f in enumerate(c.window_fractions):
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
            raise ValueError(f"window_fractions[{i}]={f!r} must be a number in (0, 1)")
        w = int(f * L)
        if w < c.engine.block_size:
            raise ValueError(f"window_fractions[{i}]={f!r} gives sliding_window={w} (of "
                             f"max_model_len={L}), shorter than block_size={c.engine.block_size}")
        arms.append((f"W={w} ({f:g} L)", w))
    names = [n for n, _ in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"window_fractions={tuple(c.window_fractions)!r} repeat a window")
    return arms


def windowed(model: LlamaConfig, window: int | None) -> LlamaConfig:
    """``model`` with every layer sliding at ``window`` (full attention for None)."""
    return dataclasses.replace(model, sliding_window=window, layer_types=None)


def build_workload(c) -> Workload:
    w = c.workload
    wl = make_workload("fixed", w.num_requests, float("inf"), max_model_len=c.engine.max_model_len,
                       seed=w.seed, prompt_len=w.prompt_len, output_len=w.output_len)
    wl.check_fits(c.engine.max_model_len)
    return wl


def check(c) -> dict:
    """Checks every setting; builds the EngineConfig, the workload and the arms (no model yet)."""
    common.check_model(c.model)
    ecfg = common.make_engine_config(c.engine)
    if ecfg.kv_layout != "paged":
        raise ValueError(f"engine.kv_layout={ecfg.kv_layout!r}: only a paged pool recycles blocks")
    arms = arm_windows(c)
    probe = LlamaConfig()  # the window checks depend on the windows and the engine only
    for _, w in arms:
        model = windowed(probe, w)
        check_supported(ecfg, model)
        recycling_window(model, ecfg)
    return {"engine_config": ecfg, "arms": arms, "workload": build_workload(c)}


# --- measurement ------------------------------------------------------------------------------
def held_blocks(engine: Engine) -> list[int]:
    """Blocks held (non-null table entries) by each device-resident running sequence."""
    bm = engine.block_manager
    return [sum(b != NULL_PAGE for b in bm.block_table(s.seq_id))
            for s in engine.scheduler.running
            if bm.has_seq(s.seq_id) and not bm.is_swapped(s.seq_id)]


def run_arm(engine: Engine, workload: Workload, bar) -> dict:
    """Serves ``workload`` offline on the idle ``engine``; the summary and the per-step trace."""
    stats0 = engine.kv_stats()
    for r in workload.requests:
        engine.add_request(r.request_id, r.engine_prompt(), SamplingParams(
            max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
    trace = {"mean_blocks": [], "max_blocks": [], "running": [], "used_blocks": [], "t_s": []}
    out_tokens, done = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:  # cumulative outputs: count each request's tokens once, at the end
                out_tokens += len(out.outputs[0].token_ids)
                done += 1
        held = held_blocks(engine)
        trace["t_s"].append(time.perf_counter() - t0)
        trace["running"].append(len(held))
        trace["mean_blocks"].append(sum(held) / len(held) if held else 0.0)
        trace["max_blocks"].append(max(held, default=0))
        trace["used_blocks"].append(engine.block_manager.num_used_blocks)
        bar.set(done)
    wall = time.perf_counter() - t0
    stats = engine.kv_stats()
    running = [n for n in trace["running"] if n]
    return {
        "wall_s": wall, "steps": len(trace["running"]),
        "output_tokens": out_tokens,
        "expected_output_tokens": sum(r.output_len for r in workload.requests),
        "throughput_tok_s": out_tokens / wall if wall > 0 else None,
        "peak_running_seqs": max(running, default=0),
        "mean_running_seqs": sum(running) / len(running) if running else 0.0,
        "median_running_seqs": float(statistics.median(running)) if running else 0.0,
        "preemptions": stats["num_preemptions"] - stats0["num_preemptions"],
        "max_blocks_per_sequence": stats["max_blocks_per_sequence"],
        "recycled_blocks": stats["recycled_blocks"] - stats0["recycled_blocks"],
        "recycled_bytes": stats["ledger"]["recycled_bytes"] - stats0["ledger"]["recycled_bytes"],
        "peak_used_blocks": max(trace["used_blocks"], default=0),
        "bytes_per_block": stats["ledger"]["bytes_per_block"],
        "trace": trace,
    }


def run(c, out_dir: Path, plan: dict | None = None) -> dict:
    plan = plan or check(c)
    ecfg, wl = plan["engine_config"], plan["workload"]
    base, params = common.load_model(c.model)
    B = ecfg.block_size
    rows = []
    for name, w in plan["arms"]:
        engine = Engine(ecfg, model_config=windowed(base, w), params=params)
        compiled = engine.warmup(logprobs=False, parallel_sampling=False) if c.warmup else 0
        bar = common.Progress(len(wl.requests), f"[sliding_window {name}]")
        res = run_arm(engine, wl, bar)
        bar.close()
        # One more block with async_scheduling: the next slot is appended before the previous
        # step is read back and recycles (paged.kv.blocks.window).
        longest = max(r.prompt_len + r.output_len for r in wl.requests) - 1  # last KV write
        bound = (math.ceil(longest / B) if w is None
                 else math.ceil(w / B) + 1 + ecfg.async_scheduling)
        rows.append({"arm": name, "sliding_window": w, "bound_blocks_per_sequence": bound,
                     "warmup_compilations": compiled, **res})
        print(f"{name}: peak running {res['peak_running_seqs']}, preemptions "
              f"{res['preemptions']}, max blocks/seq {res['max_blocks_per_sequence']} "
              f"(bound {bound}), recycled {res['recycled_blocks']}, "
              f"{res['throughput_tok_s']:.1f} tok/s, {res['steps']} steps, {res['wall_s']:.1f} s",
              flush=True)
    print(format_table(rows, ecfg))
    payload = {
        "study": "sliding_window", "evidence": wl.evidence, "config": c.to_dict(),
        "engine_config": dataclasses.asdict(ecfg),
        "model": {"name": c.model, "weights": "random" if c.model == "random-small" else
                  "trained (with full attention)", "config": base.to_dict()},
        "workload": {"name": wl.name, "meta": wl.meta, "summary": wl.summary()},
        "definitions": {
            "blocks held": "non-null block-table entries of a device-resident running sequence, "
                           "read after each engine step",
            "bound_blocks_per_sequence": "full attention: ceil(longest sequence's KV / B); "
                                         "a window: ceil(W / B) + 1 (+ 1 with "
                                         "async_scheduling) once the prompt is behind it; a "
                                         "sequence preempted by recompute is readmitted with "
                                         "its generated tokens as prompt and takes all of its "
                                         "blocks at admission, so it can hold more for a step",
            "peak_running_seqs": "admitted concurrency: most device-resident running sequences "
                                 "after any step (offline: every short prompt is admitted at "
                                 "t = 0, so this is the request count in every arm)",
            "mean_running_seqs": "device-resident running sequences, mean over the steps that "
                                 "run any (median_running_seqs: their median)",
            "throughput_tok_s": "output tokens / wall seconds of the offline run (all requests "
                                "at t = 0; compilation excluded when config.warmup)"},
        "not_measured": "capacity at a latency SLO (experiments.sliding_window_capacity) and "
                        "the fleet what-if (experiments.fleet, variants window and "
                        "window_fractions): other studies",
        "arms": rows, "load_avg": os.getloadavg(), "provenance": common.provenance()}
    path = common.write_result(out_dir / "sliding_window.json", payload)
    if c.plots:
        plot(rows, ecfg, out_dir / "sliding_window.png")
    print(f"wrote {path}")
    return payload


# --- report -----------------------------------------------------------------------------------
def format_table(rows: list[dict], ecfg) -> str:
    lines = [f"same pool: num_blocks={ecfg.num_blocks}, B={ecfg.block_size}, "
             f"max_model_len={ecfg.max_model_len}, offline",
             f"{'arm':18s}{'peak run':>9s}{'mean run':>9s}{'med run':>8s}{'preempt':>8s}"
             f"{'max blk':>8s}"
             f"{'bound':>6s}{'recycled':>9s}{'tok/s':>8s}{'steps':>7s}"]
    for r in rows:
        lines.append(f"{r['arm']:18s}{r['peak_running_seqs']:>9d}{r['mean_running_seqs']:>9.1f}"
                     f"{r['median_running_seqs']:>8.1f}"
                     f"{r['preemptions']:>8d}{r['max_blocks_per_sequence']:>8d}"
                     f"{r['bound_blocks_per_sequence']:>6d}{r['recycled_blocks']:>9d}"
                     f"{r['throughput_tok_s']:>8.1f}{r['steps']:>7d}")
    return "\n".join(lines)


def plot(rows: list[dict], ecfg, path: Path) -> Path:
    """Mean blocks per running sequence and running sequences, against the engine step."""
    plt = plots.pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for r in rows:
        line, = a.plot(r["trace"]["mean_blocks"], label=r["arm"], lw=1)
        a.axhline(r["bound_blocks_per_sequence"], color=line.get_color(), ls=":", lw=0.8)
        b.plot(r["trace"]["running"], label=r["arm"], lw=1, color=line.get_color())
    a.set_xlabel("engine step")
    a.set_ylabel("KV blocks per running sequence (mean)")
    a.set_title(f"blocks held (dotted: bound); {r['bytes_per_block']} B/block")
    b.set_xlabel("engine step")
    b.set_ylabel("running sequences")
    b.set_title(f"same pool: {ecfg.num_blocks} blocks of {ecfg.block_size}")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    plots.save(fig, path)
    return path


def main(c, plan):
    run(c, common.output_dir(c, "sliding_window"), plan)


if __name__ == "__main__":
    common.run("sliding_window", main, check)
