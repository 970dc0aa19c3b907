"""Factorial ablation: operator (attention_impl) x allocation (kv_layout) x scheduling (x prefix
caching), every arm on the same workload, one table, and each factor's main effect.

A factor's main effect on a metric is the mean over arms at one level minus the mean at the other,
the other factors averaged out (balanced design), so operator, allocation and scheduling are
isolated as the seed document asks.

Writes ``ablate.json`` and ``replay.json`` (one record per cell, each on a new engine, named by
the cell: ``python -m experiments.replay --from=<dir> [--arm=<cell>]`` re-executes it exactly).
"""

from __future__ import annotations

import itertools

import numpy as np

from experiments import common, serving
from experiments.replay import replay_command
from paged.workload.workload import check_same_evidence

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


def check(c) -> dict:
    """Checks every setting; builds the workload and every arm's EngineConfig (no model yet)."""
    serving.check_serving(c)
    for name in c.factors.keys():
        levels = c.factors[name]
        if not isinstance(levels, (tuple, list)) or not levels:
            raise ValueError(f"factors.{name}={levels!r} must be a non-empty tuple of levels")
    common.check_unset(c.engine, list(c.factors.keys()), "config.factors")
    grid = [(",".join(f"{v}" for v in f.values()), f,
             serving.engine_config(c, f, where="factors")) for f in arms(c.factors)]
    workload = serving.build_workload(c.workload, c.engine.max_model_len)
    check_same_evidence([workload])
    return {"workload": workload, "grid": grid}


def main(c, plan):
    out_dir = common.output_dir(c, "ablate")
    workload, grid = plan["workload"], plan["grid"]
    model = common.load_model(c.model)
    rows, replays = [], []
    with common.Progress(len(grid), "[ablate]", unit="cell") as bar:
        for name, factors, engine_config in grid:
            bar.set(bar.n, cell=name)
            engine = serving.build_engine(engine_config, model)
            res = serving.run_arm(name, engine, workload, ttft_slo_ms=c.ttft_slo_ms,
                                  tpot_slo_ms=c.tpot_slo_ms, max_wall_s=c.max_wall_s,
                                  model_name=c.model)
            rows.append({"name": name, "factors": factors, "summary": res.summary,
                         "wall_s": res.wall_s})
            replays.append(res.replay)  # a new engine per cell: every cell replays
            bar.update()
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
    common.write_result(out_dir / "ablate.json", {
        "study": "ablate", "evidence": workload.evidence, "config": c.to_dict(),
        "workload": {"name": workload.name, "seed": workload.seed, "meta": workload.meta},
        "arms": rows, "main_effects": effects, "provenance": common.provenance()})
    print(f"wrote {out_dir}/ablate.json")
    if serving.write_replay_records(out_dir / "replay.json", replays):
        print(f"replay: {replay_command(out_dir)}")


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    common.run("ablate", main, check)
