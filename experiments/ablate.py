"""Factorial ablation: operator (attention_impl) x allocation (kv_layout) x scheduling, every cell
on the same workload, repeated; each factor's main effect and every interaction separated.

For two-level factors coded -1 / +1 (the first level listed is +1), the effect of a set of factors
S on a metric is mean(y where prod_{f in S} x_f = +1) - mean(y where it is -1): for one factor its
main effect (first level minus second, the others averaged out: a balanced design), for two or
more their interaction (e.g. allocation x scheduling: how much the paged-minus-contiguous gap
changes with the scheduler, halved; the usual 2^k contrast). Each repeat is one full replicate:
effects are computed per repeat and reported as median, min and max over repeats, like each
cell's metrics. Cells run in the listed order in even repeats and reversed in odd ones, so a
drift in the shared machine's load does not fall on one level.

Each cell's engine is built and warmed up once and reused by its repeats, each starting cold
(`serving.start_cold`: nothing in flight, the prefix cache emptied). Writes ``ablate.json`` and
``replay.json`` (one record per run, named ``<cell>#<repeat>``: ``python -m experiments.replay
--from=<dir> [--arm=<name>]`` re-executes it exactly). ``simple_ratios``: each factor's first
level over its second at every combination of the other factors (output tok/s), per repeat.
"""

from __future__ import annotations

import itertools

import numpy as np

from experiments import common, serving
from experiments.replay import replay_command
from paged.workload.workload import check_same_evidence

METRICS = ("output_throughput", "request_goodput", "p99_ttft_ms", "mean_queue_ms", "p99_tpot_ms",
           "p99_e2el_ms", "engine_preemptions", "peak_used_blocks")


def arms(factors) -> list[dict]:
    names = list(factors.keys())
    return [dict(zip(names, levels)) for levels in itertools.product(*(factors[n] for n in names))]


def cell_name(factors: dict) -> str:
    return ",".join(f"{v}" for v in factors.values())


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


def contrast_effects(rows: list[dict], factors) -> dict:
    """Main effects and interactions of the two-level factors (module docstring), per repeat,
    summarized as `spread` over repeats: ``{"a": {metric: ...}, "a x b": {...}, ...}``. A
    repeat missing a cell or a value contributes nothing for that metric."""
    two = [n for n in factors.keys() if len(factors[n]) == 2]
    repeats = sorted({r["repeat"] for r in rows})
    out = {}
    for size in range(1, len(two) + 1):
        for subset in itertools.combinations(two, size):
            per_metric = {}
            for metric in METRICS:
                per_repeat = [_contrast(rows, factors, subset, metric, rep) for rep in repeats]
                per_metric[metric] = {**common.spread(per_repeat), "per_repeat": per_repeat}
            out[" x ".join(subset)] = per_metric
    return out


def _contrast(rows, factors, subset, metric, repeat) -> float | None:
    plus, minus = [], []
    for r in rows:
        if r["repeat"] != repeat:
            continue
        v = r["summary"].get(metric)
        if v is None:
            return None
        sign = 1
        for name in subset:
            sign *= 1 if r["factors"][name] == factors[name][0] else -1
        (plus if sign > 0 else minus).append(float(v))
    if not plus or not minus or len(plus) != len(minus):
        return None
    return float(np.mean(plus) - np.mean(minus))


def simple_ratios(rows: list[dict], factors, metric: str = "output_throughput") -> dict:
    """Per two-level factor and per combination of the other factors' levels: `spread` over
    repeats of ``metric`` at the first level over the second (e.g. paged / contiguous with the
    xla operator and continuous batching): ``{factor: {"xla,continuous": spread}}``."""
    by_key = {(r["repeat"], tuple(sorted(r["factors"].items()))): r["summary"].get(metric)
              for r in rows}
    repeats = sorted({r["repeat"] for r in rows})
    out = {}
    for name in [n for n in factors.keys() if len(factors[n]) == 2]:
        first, second = factors[name]
        others = [n for n in factors.keys() if n != name]
        out[name] = {}
        for combo in itertools.product(*(factors[n] for n in others)):
            fixed = dict(zip(others, combo))
            ratios = []
            for rep in repeats:
                a = by_key.get((rep, tuple(sorted({**fixed, name: first}.items()))))
                b = by_key.get((rep, tuple(sorted({**fixed, name: second}.items()))))
                ratios.append(a / b if a is not None and b else None)
            out[name][",".join(str(v) for v in combo) or "-"] = common.spread(ratios)
    return out


def scalars(summary: dict) -> dict:
    """A run's summary as stored: every scalar, without the per-request arrays (24 runs of 192
    requests would make the JSON 8 MB)."""
    return {k: v for k, v in summary.items() if not isinstance(v, list)}


def cell_summaries(rows: list[dict]) -> dict:
    """Per cell: `spread` over repeats of every metric, and the wall times."""
    out = {}
    for r in rows:
        out.setdefault(r["cell"], {"factors": r["factors"], "runs": []})["runs"].append(r)
    return {name: {"factors": c["factors"],
                   **{m: common.spread([run["summary"].get(m) for run in c["runs"]]) for m in METRICS},
                   "wall_s": [run["wall_s"] for run in c["runs"]]}
            for name, c in out.items()}


def check(c) -> dict:
    """Checks every setting; builds the workload and every cell's EngineConfig (no model yet)."""
    serving.check_serving(c)
    for name in c.factors.keys():
        levels = c.factors[name]
        if not isinstance(levels, (tuple, list)) or not levels:
            raise ValueError(f"factors.{name}={levels!r} must be a non-empty tuple of levels")
    if not isinstance(c.repeats, int) or isinstance(c.repeats, bool) or c.repeats < 1:
        raise ValueError(f"repeats={c.repeats!r} must be an int >= 1")
    common.check_unset(c.engine, list(c.factors.keys()), "config.factors")
    grid = [(cell_name(f), f, serving.engine_config(c, f, where="factors"))
            for f in arms(c.factors)]
    workload = serving.build_workload(c.workload, c.engine.max_model_len)
    check_same_evidence([workload])
    return {"workload": workload, "grid": grid}


def schedule(grid: list, repeats: int) -> list[tuple[int, tuple]]:
    """``(repeat, cell)`` in run order: the grid forward in even repeats, reversed in odd ones."""
    return [(rep, cell) for rep in range(repeats)
            for cell in (grid if rep % 2 == 0 else grid[::-1])]


def main(c, plan):
    out_dir = common.output_dir(c, "ablate")
    workload, grid = plan["workload"], plan["grid"]
    model = common.load_model(c.model)
    rows, replays, engines = [], [], {}
    runs = schedule(grid, c.repeats)
    with common.Progress(len(runs), "[ablate]", unit="run") as bar:
        for rep, (name, factors, engine_config) in runs:
            bar.set(bar.n, cell=f"{name}#{rep}")
            if name not in engines:  # one engine per cell, built and warmed once
                engines[name] = serving.build_engine(engine_config, model)
            elif not serving.start_cold(engines[name]):  # a reused engine starts cold again
                raise RuntimeError(f"ablate: cell {name}: the prefix cache could not be emptied")
            engine = engines[name]
            compiled_before = engine.num_compilations
            res = serving.run_arm(f"{name}#{rep}", engine, workload, ttft_slo_ms=c.ttft_slo_ms,
                                  tpot_slo_ms=c.tpot_slo_ms, max_wall_s=c.max_wall_s,
                                  model_name=c.model, progress="tty")
            rows.append({"name": f"{name}#{rep}", "cell": name, "repeat": rep,
                         "factors": factors, "summary": scalars(res.summary),
                         "wall_s": res.wall_s,
                         "compilations_in_run": res.num_compilations - compiled_before})
            replays.append(res.replay)  # every run starts cold: every run replays
            bar.update()
    cells = cell_summaries(rows)
    _print_cells(c, cells)
    effects = main_effects(rows, c.factors)
    contrasts = contrast_effects(rows, c.factors)
    _print_effects(contrasts)
    ratios = simple_ratios(rows, c.factors)
    for name, per_combo in ratios.items():
        print(f"  {name} output tok/s ratio (first / second level): " + "  ".join(
            f"{k}={_fmt_spread(v, 2)}" for k, v in per_combo.items()))
    common.write_result(out_dir / "ablate.json", {
        "study": "ablate", "evidence": workload.evidence, "config": c.to_dict(),
        "workload": {"name": workload.name, "seed": workload.seed, "meta": workload.meta},
        "arms": rows, "cells": cells, "main_effects": effects, "effects": contrasts,
        "simple_ratios": {"output_throughput": ratios},
        "provenance": common.provenance()})
    print(f"wrote {out_dir}/ablate.json")
    if serving.write_replay_records(out_dir / "replay.json", replays):
        print(f"replay: {replay_command(out_dir)}")


def _print_cells(c, cells: dict) -> None:
    print("cells (median [min, max] over repeats):")
    header = "".join(f"{n:>16s}" for n in c.factors.keys()) + "".join(f"{m:>26s}" for m in METRICS)
    print(header)
    for cell in cells.values():
        line = "".join(f"{str(v):>16s}" for v in cell["factors"].values())
        line += "".join(f"{_fmt_spread(cell[m]):>26s}" for m in METRICS)
        print(line)


def _print_effects(contrasts: dict) -> None:
    print("main effects and interactions (first level minus second; median [min, max] over "
          "repeats):")
    for name, per_metric in contrasts.items():
        print(f"  {name}: " + "  ".join(f"{m}={_fmt_spread(s)}" for m, s in per_metric.items()))


def _fmt_spread(s: dict, digits: int = 1) -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f},{s['max']:.{digits}f}]"


if __name__ == "__main__":
    common.run("ablate", main, check)
