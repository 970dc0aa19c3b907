"""Sliding windows at the same pool bytes: capacity at a latency SLO on the CPU engine.

The arms of `experiments.sliding_window` (the model with full attention, and the same weights
with every layer sliding at ``W = fraction * max_model_len``, one arm per
``window_fractions``), every arm with the same ``num_blocks`` (same pool bytes), each swept over
the request rates ``rates`` by `experiments.capacity`'s ``sweep_arm`` (a new warmed-up engine per
point, real time): ``rate * duration_s`` long-output requests (every one ``prompt_len`` prompt
tokens and ``output_len`` output tokens, greedy, ``ignore_eos``) with Poisson arrivals. A point
meets the SLO when every request finished with p99 TTFT and p99 TPOT within ``ttft_slo_ms`` /
``tpot_slo_ms``; an arm's capacity is the highest grid rate at which it and every lower one did
(`experiments.capacity.capacity`). Per point, beside the serving summary, ``kv`` holds the
engine's ``kv_stats()`` after the run: ``max_blocks_per_sequence``, ``recycled_blocks`` (and the
ledger's ``recycled_bytes``) and preemptions.

Writes ``capacity.json`` (config, arms with every point's summary and capacity, the ratio of each
window arm's capacity to full attention's, provenance) and ``capacity.png`` (p99 TTFT and TPOT
against the rate per arm).
"""

from __future__ import annotations

import os

from experiments import capacity, common, plots, sliding_window
from paged.config.support import check_supported
from paged.kv.spec import recycling_window
from paged.models.config import LlamaConfig
from paged.workload.workload import make_workload


def check(c) -> dict:
    """Checks every setting; builds the EngineConfig, the arms and every rate's workload."""
    common.check_model(c.model)
    ecfg = common.make_engine_config(c.engine)
    if ecfg.kv_layout != "paged":
        raise ValueError(f"engine.kv_layout={ecfg.kv_layout!r}: only a paged pool recycles blocks")
    arms = sliding_window.arm_windows(c)
    probe = LlamaConfig()  # the window checks depend on the windows and the engine only
    for _, w in arms:
        model = sliding_window.windowed(probe, w)
        check_supported(ecfg, model)
        recycling_window(model, ecfg)
    if not c.rates:
        raise ValueError("rates=() names no rate")
    common.check_positive(duration_s=c.duration_s, max_drain_s=c.max_drain_s,
                          ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms,
                          **{f"rates[{i}]": r for i, r in enumerate(c.rates)})
    if isinstance(c.stop_after_failures, bool) or c.stop_after_failures < 1:
        raise ValueError(f"stop_after_failures={c.stop_after_failures!r} must be an integer >= 1")
    w = c.workload
    workloads = {}
    for rate in sorted(float(r) for r in c.rates):
        wl = make_workload("fixed", max(2, round(rate * c.duration_s)), rate,
                           max_model_len=ecfg.max_model_len, seed=w.seed,
                           prompt_len=w.prompt_len, output_len=w.output_len)
        wl.check_fits(ecfg.max_model_len)
        workloads[rate] = wl
    return {"engine_config": ecfg, "arms": arms, "workloads": workloads}


def kv_figures(engine) -> dict:
    """A point's KV figures, read from its engine after the run (every point a new engine)."""
    stats = engine.kv_stats()
    return {"kv": {"max_blocks_per_sequence": stats["max_blocks_per_sequence"],
                   "recycled_blocks": stats["recycled_blocks"],
                   "recycled_bytes": stats["ledger"]["recycled_bytes"],
                   "preemptions": stats["num_preemptions"]}}


def run(c, out_dir, plan: dict | None = None) -> dict:
    plan = plan or check(c)
    ecfg = plan["engine_config"]
    base, params = common.load_model(c.model)
    arms = []
    for name, w in plan["arms"]:
        load_before = os.getloadavg()
        points = capacity.sweep_arm(c, name, ecfg, plan["workloads"],
                                    (sliding_window.windowed(base, w), params), extra=kv_figures)
        arms.append({"name": name, "sliding_window": w, "points": points,
                     "capacity_rps": capacity.capacity(points), "load_before": load_before,
                     "load_after": os.getloadavg()})
    full = arms[0]["capacity_rps"]
    ratios = {a["name"]: (a["capacity_rps"] / full if a["capacity_rps"] and full else None)
              for a in arms[1:]}
    for a in arms:
        print(f"capacity {a['name']:18s} {a['capacity_rps']} req/s"
              + (f"  ({ratios[a['name']]:.2f} x full)" if ratios.get(a["name"]) else ""))
    evidence = {wl.evidence for wl in plan["workloads"].values()}
    payload = {
        "study": "sliding_window_capacity", "evidence": evidence.pop() if len(evidence) == 1 else
        sorted(evidence), "config": c.to_dict(), "num_blocks": ecfg.num_blocks,
        "model": {"name": c.model, "weights": "random" if c.model == "random-small" else
                  "trained (with full attention)"},
        "slo": {"p99_ttft_ms": c.ttft_slo_ms, "p99_tpot_ms": c.tpot_slo_ms},
        "arms": arms, "capacity_over_full": ratios, "provenance": common.provenance()}
    path = common.write_result(out_dir / "capacity.json", payload)
    if c.plots:
        plots.capacity_curves(arms, c.ttft_slo_ms, c.tpot_slo_ms, out_dir / "capacity.png")
    print(f"wrote {path}")
    return payload


def main(c, plan):
    run(c, common.output_dir(c, "sliding_window_capacity"), plan)


if __name__ == "__main__":
    common.run("sliding_window_capacity", main, check)
