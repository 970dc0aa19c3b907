"""Factorial ablation: operator (attention_impl) x allocation (kv_layout) x scheduling (x prefix
caching), every arm on the same workload, one table, and each factor's main effect.

A factor's main effect on a metric is the mean over arms at one level minus the mean at the other,
the other factors averaged out (balanced design), so operator, allocation and scheduling are
isolated as the seed document asks.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from absl import app
from ml_collections import config_flags

from experiments import common, serving

_CONFIG = config_flags.DEFINE_config_file(
    "config", str(Path(__file__).parent / "configs" / "ablate.py"), "Ablation config.",
    lock_config=True)

METRICS = ("output_throughput", "request_goodput", "p99_ttft_ms", "p99_tpot_ms", "p99_e2el_ms")


def arms(factors) -> list[dict]:
    names = list(factors.keys())
    return [dict(zip(names, levels)) for levels in itertools.product(*(factors[n] for n in names))]


def main_effects(rows: list[dict], factors) -> dict:
    """For each factor with two or more levels: metric mean per level (others averaged out)."""
    effects = {}
    for name in factors.keys():
        levels = list(factors[name])
        if len(levels) < 2:
            continue
        effects[name] = {}
        for metric in METRICS:
            means = {}
            for level in levels:
                vals = [r["summary"][metric] for r in rows
                        if r["factors"][name] == level and r["summary"].get(metric) is not None]
                means[str(level)] = float(np.mean(vals)) if vals else None
            effects[name][metric] = means
    return effects


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    c = _CONFIG.value
    out_dir = Path(c.output_dir) if c.output_dir else common.results_dir("ablate")
    model = common.load_model(c.model)
    workload = serving.build_workload(c.workload, c.engine.max_model_len)
    rows = []
    grid = arms(c.factors)
    for k, factors in enumerate(grid):
        name = ",".join(f"{v}" for v in factors.values())
        print(f"[{k + 1}/{len(grid)}] {name}", flush=True)
        engine = serving.build_engine(serving.engine_config(c, c.model, factors), model)
        res = serving.run_arm(name, engine, workload, ttft_slo_ms=c.ttft_slo_ms,
                              tpot_slo_ms=c.tpot_slo_ms, max_wall_s=c.max_wall_s)
        rows.append({"name": name, "factors": factors, "summary": res.summary, "wall_s": res.wall_s})
    header = "".join(f"{n:>22s}" for n in c.factors.keys()) + "".join(f"{m:>20s}" for m in METRICS)
    print(header)
    for r in rows:
        cells = "".join(f"{str(v):>22s}" for v in r["factors"].values())
        cells += "".join(f"{_fmt(r['summary'].get(m)):>20s}" for m in METRICS)
        print(cells)
    effects = main_effects(rows, c.factors)
    print("main effects (mean over the other factors):")
    for name, per_metric in effects.items():
        for metric, means in per_metric.items():
            print(f"  {name:22s} {metric:20s} " + "  ".join(f"{lv}={_fmt(v)}" for lv, v in means.items()))
    common.write_json(out_dir / "ablate.json", {
        "study": "ablate", "evidence": workload.evidence, "config": c.to_dict(),
        "workload": {"name": workload.name, "seed": workload.seed, "meta": workload.meta},
        "arms": rows, "main_effects": effects, "provenance": common.provenance()})
    print(f"wrote {out_dir}/ablate.json")


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    app.run(main)
