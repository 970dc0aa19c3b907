"""Online serving study: one workload in real time, several engine arms, one side-by-side table.

The default config is the project's main job (``make run``): paged KV + continuous batching beside
contiguous KV + static batching, same model, same sampling, same KV pool bytes, same constructed
ShareGPT-like Poisson workload. Writes ``summary.json`` (every request's record, per-arm summaries,
KV-usage traces, config, provenance) and two plots (latency CDFs, KV usage by ledger category).
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app
from ml_collections import config_flags

from experiments import common, plots, serving
from paged import EngineConfig
from paged.workload import Workload, make_workload

_CONFIG = config_flags.DEFINE_config_file(
    "config", str(Path(__file__).parent / "configs" / "serve.py"), "Serving config.", lock_config=True)


def load_model(name: str):
    """``None`` (the engine loads a bundled model) or ``(config, params)`` for "random-small"."""
    if name != "random-small":
        return None
    from paged.models.config import LlamaConfig
    from paged.models.registry import init_params

    cfg = LlamaConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=128)
    return cfg, init_params(cfg, 0)


def build_workload(w, max_model_len: int) -> Workload:
    if w.trace:
        wl = Workload.from_jsonl(w.trace)
        if any(r.prompt_token_ids is None and r.prompt is None for r in wl.requests):
            wl = wl.with_synthetic_prompts(w.seed)
        wl.check_fits(max_model_len)
        return wl
    return make_workload(w.kind, w.num_requests, w.rate, burstiness=w.burstiness,
                         max_model_len=max_model_len, seed=w.seed)


def engine_config(c, model_name: str, overrides: dict) -> EngineConfig:
    kwargs = dict(c.engine.to_dict())
    kwargs.update(overrides)
    if model_name != "random-small":
        kwargs["model"] = model_name
    return EngineConfig(**kwargs)


TABLE_ROWS = (
    ("completed", "completed", "{:.0f}"),
    ("rejected+aborted+timeout", None, "{}"),
    ("request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("mean TTFT (ms)", "mean_ttft_ms", "{:.0f}"),
    ("p99 TTFT (ms)", "p99_ttft_ms", "{:.0f}"),
    ("mean TPOT (ms)", "mean_tpot_ms", "{:.1f}"),
    ("p99 TPOT (ms)", "p99_tpot_ms", "{:.1f}"),
    ("p99 ITL (ms)", "p99_itl_ms", "{:.1f}"),
    ("p99 E2E (ms)", "p99_e2el_ms", "{:.0f}"),
    ("goodput (req/s in SLO)", "request_goodput", "{:.2f}"),
    ("preemptions", "engine_preemptions", "{}"),
    ("prefix-cache hit tokens", "prefix_cache_hit_tokens", "{}"),
)


def format_table(results) -> str:
    width = max(18, *(len(r.name) + 2 for r in results))
    lines = [f"{'':28s}" + "".join(f"{r.name:>{width}s}" for r in results)]
    for label, key, fmt in TABLE_ROWS:
        cells = []
        for r in results:
            s = r.summary
            if key is None:
                v = f"{s['num_rejected']}+{s['num_aborted']}+{s['num_timeout']}"
            else:
                v = "-" if s.get(key) is None else fmt.format(s[key])
            cells.append(f"{v:>{width}s}")
        lines.append(f"{label:28s}" + "".join(cells))
    return "\n".join(lines)


def run(c, out_dir: Path) -> dict:
    model = load_model(c.model)
    workload = build_workload(c.workload, c.engine.max_model_len)
    print(f"workload: {len(workload)} requests, evidence={workload.evidence}, "
          f"{json.dumps(workload.summary(), default=str)[:300]}")
    results = []
    for name, overrides in c.arms:
        engine = serving.build_engine(engine_config(c, c.model, dict(overrides)), model)
        results.append(serving.run_arm(name, engine, workload, ttft_slo_ms=c.ttft_slo_ms,
                                       tpot_slo_ms=c.tpot_slo_ms, max_wall_s=c.max_wall_s))
        del engine
    print(format_table(results))
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


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    c = _CONFIG.value
    out_dir = Path(c.output_dir) if c.output_dir else common.results_dir("serve")
    run(c, out_dir)


if __name__ == "__main__":
    app.run(main)
