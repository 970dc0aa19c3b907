"""Online serving study: one workload in real time, several engine arms, one side-by-side table.

The default config is the project's main job (``make run``): paged KV + continuous batching beside
contiguous KV + static batching, same model, same sampling, same KV pool bytes, same constructed
ShareGPT-like Poisson workload. Writes ``summary.json`` (every request's record, per-arm summaries,
KV-usage traces, config, provenance) and two plots (latency CDFs, KV usage by ledger category).
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments import common, plots, serving
from paged.workload import check_same_evidence


def check(c) -> dict:
    """Checks every setting and builds the workload and each arm's EngineConfig (no model yet)."""
    serving.check_serving(c)
    engines = serving.check_arms(c)
    workload = serving.build_workload(c.workload, c.engine.max_model_len)
    check_same_evidence([workload])
    return {"workload": workload, "engines": engines}


def run(c, out_dir: Path, plan: dict | None = None) -> dict:
    plan = plan or check(c)
    workload = plan["workload"]
    model = common.load_model(c.model)
    print(f"workload: {len(workload)} requests, evidence={workload.evidence}, "
          f"{json.dumps(workload.summary(), default=str)[:300]}")
    results = []
    for name, engine_config in plan["engines"]:
        engine = serving.build_engine(engine_config, model)
        results.append(serving.run_arm(name, engine, workload, ttft_slo_ms=c.ttft_slo_ms,
                                       tpot_slo_ms=c.tpot_slo_ms, max_wall_s=c.max_wall_s))
        del engine
    print(serving.format_table(results))
    payload = {
        "study": "serve", "evidence": workload.evidence, "config": c.to_dict(),
        "workload": {"name": workload.name, "seed": workload.seed, "meta": workload.meta,
                     "summary": workload.summary()},
        "arms": [{"name": r.name, "summary": r.summary, "engine_config": r.engine_config,
                  "wall_s": r.wall_s, "num_compilations": r.num_compilations, "trace": r.trace,
                  "records": [rec.as_dict() for rec in r.records]} for r in results],
        "provenance": common.provenance(),
    }
    common.write_json(out_dir / "summary.json", payload)
    if c.plots:
        plots.latency_cdfs(results, out_dir / "latency_cdf.png")
        plots.kv_usage(results, out_dir / "kv_usage.png")
    print(f"wrote {out_dir}/summary.json" + (" and plots" if c.plots else ""))
    return payload


def main(c, plan):
    run(c, common.output_dir(c, "serve"), plan)


if __name__ == "__main__":
    common.run("serve", main, check)
