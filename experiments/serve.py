"""Online serving study: one workload in real time, several engine arms, one side-by-side table.

The default config is the project's main job (``make run``): paged KV + continuous batching beside
contiguous KV + static batching, same model, same sampling, same KV pool bytes, same constructed
ShareGPT-like Poisson workload; then each arm serves ``real_arrivals`` too (a window of a real
Azure trace, ``evidence: real``, its derivations in its label), reported as one line per arm and
kept apart from the constructed comparison. Writes ``summary.json`` (every request's record, per-arm summaries,
KV-usage traces, config, provenance), ``replay.json`` (what ``python -m experiments.replay``
re-executes exactly) and two plots (latency CDFs, KV usage by ledger category).
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments import common, plots, serving
from experiments.replay import replay_command
from paged.workload.workload import check_same_evidence


def check(c) -> dict:
    """Checks every setting and builds the workload and each arm's EngineConfig (no model yet)."""
    serving.check_serving(c)
    engines = serving.check_arms(c)
    workload = serving.build_workload(c.workload, c.engine.max_model_len)
    check_same_evidence([workload])
    real = None
    if "real_arrivals" in c and c.real_arrivals.azure:
        try:
            real = serving.real_workload(c.real_arrivals, c.engine.max_model_len)
        except (ValueError, TypeError) as e:
            raise type(e)(f"real_arrivals: {e}") from None
        check_same_evidence([real])
    return {"workload": workload, "engines": engines, "real_arrivals": real}


def run(c, out_dir: Path, plan: dict | None = None) -> dict:
    plan = plan or check(c)
    workload = plan["workload"]
    model = common.load_model(c.model)
    print(f"workload: {len(workload)} requests, {workload.label()}, "
          f"{json.dumps(workload.summary(), default=str)[:300]}")
    results = []
    for name, engine_config in plan["engines"]:
        engine = serving.build_engine(engine_config, model)
        results.append(serving.run_arm(name, engine, workload, ttft_slo_ms=c.ttft_slo_ms,
                                       tpot_slo_ms=c.tpot_slo_ms, max_wall_s=c.max_wall_s,
                                       model_name=c.model))
        del engine
    print(serving.format_table(results))
    real = plan.get("real_arrivals")
    real_results = []
    if real is not None:
        print(f"real arrivals: {len(real)} requests over {real.duration_s:.1f} s; {real.label()}")
        for name, engine_config in plan["engines"]:
            engine = serving.build_engine(engine_config, model)
            real_results.append(serving.run_arm(f"{name}", engine, real, ttft_slo_ms=c.ttft_slo_ms,
                                                tpot_slo_ms=c.tpot_slo_ms, max_wall_s=c.max_wall_s,
                                                model_name=c.model))
            del engine
            print("  " + serving.format_line(real_results[-1]), flush=True)
    payload = {
        "study": "serve", "evidence": workload.evidence, "config": c.to_dict(),
        "workload": {"name": workload.name, "seed": workload.seed, "meta": workload.meta,
                     "summary": workload.summary()},
        "arms": [{"name": r.name, "summary": r.summary, "engine_config": r.engine_config,
                  "wall_s": r.wall_s, "num_compilations": r.num_compilations, "trace": r.trace,
                  "records": [rec.as_dict() for rec in r.records]} for r in results],
        "provenance": common.provenance(),
    }
    if real is not None:  # a separate comparison: its own evidence label and derivations
        payload["real_arrivals"] = {
            "evidence": real.evidence, "label": real.label(),
            "workload": {"name": real.name, "meta": real.meta, "summary": real.summary()},
            "arms": [{"name": r.name, "summary": r.summary, "engine_config": r.engine_config,
                      "wall_s": r.wall_s, "records": [rec.as_dict() for rec in r.records]}
                     for r in real_results]}
    common.write_result(out_dir / "summary.json", payload)
    if serving.write_replay(out_dir / "replay.json", results, real_results):
        print(f"replay: {replay_command(out_dir)}")
    if c.plots:
        plots.latency_cdfs(results, out_dir / "latency_cdf.png")
        plots.kv_usage(results, out_dir / "kv_usage.png")
    print(f"wrote {out_dir}/summary.json" + (" and plots" if c.plots else ""))
    return payload


def main(c, plan):
    run(c, common.output_dir(c, "serve"), plan)


if __name__ == "__main__":
    common.run("serve", main, check)
