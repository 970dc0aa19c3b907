"""Capacity study: request-rate sweep per arm, the highest rate within the SLO, and the ratio.

Writes ``capacity.json`` (every point's summary, the capacities, the ratio) and ``capacity.png``
(p99 TTFT and p99 TPOT against the rate, the SLOs drawn in).
"""

from __future__ import annotations

from pathlib import Path

from absl import app
from ml_collections import config_flags

from experiments import common, plots, serving

_CONFIG = config_flags.DEFINE_config_file(
    "config", str(Path(__file__).parent / "configs" / "capacity.py"), "Capacity config.",
    lock_config=True)


def meets_slo(summary: dict, ttft_slo_ms: float, tpot_slo_ms: float) -> bool:
    """Every request finished, p99 TTFT and p99 TPOT within the SLO."""
    if summary["completed"] != summary["num_requests"]:
        return False
    ttft, tpot = summary.get("p99_ttft_ms"), summary.get("p99_tpot_ms")
    return ttft is not None and ttft <= ttft_slo_ms and (tpot is None or tpot <= tpot_slo_ms)


def capacity(points: list[dict]) -> float | None:
    """Highest rate such that it and every lower swept rate met the SLO (None if the lowest missed)."""
    best = None
    for p in sorted(points, key=lambda p: p["rate"]):
        if not p["meets_slo"]:
            break
        best = p["rate"]
    return best


def sweep_arm(c, name: str, overrides: dict, model) -> list[dict]:
    points, misses = [], 0
    for rate in c.rates:
        with c.unlocked():
            c.workload.rate = float(rate)
            c.workload.num_requests = max(2, round(rate * c.duration_s))
        workload = serving.build_workload(c.workload, c.engine.max_model_len)
        engine = serving.build_engine(serving.engine_config(c, c.model, overrides), model)
        res = serving.run_arm(f"{name}@{rate:g}", engine, workload, ttft_slo_ms=c.ttft_slo_ms,
                              tpot_slo_ms=c.tpot_slo_ms,
                              max_wall_s=workload.duration_s + c.max_drain_s)
        ok = meets_slo(res.summary, c.ttft_slo_ms, c.tpot_slo_ms)
        points.append({"rate": float(rate), "meets_slo": ok, "summary": res.summary,
                       "evidence": workload.evidence, "wall_s": res.wall_s})
        s = res.summary
        print(f"  {name:20s} rate {rate:5.2f}/s  p99 TTFT {_f(s.get('p99_ttft_ms'))} ms  p99 TPOT "
              f"{_f(s.get('p99_tpot_ms'))} ms  completed {s['completed']}/{s['num_requests']}  "
              f"{'OK' if ok else 'miss'}", flush=True)
        misses = 0 if ok else misses + 1
        if misses >= c.stop_after_failures:
            break
    return points


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    c = _CONFIG.value
    if len(c.arms) < 2:
        raise app.UsageError("capacity needs at least two arms (the ratio is first over second)")
    out_dir = Path(c.output_dir) if c.output_dir else common.results_dir("capacity")
    model = common.load_model(c.model)
    arms = []
    for name, overrides in c.arms:
        points = sweep_arm(c, name, dict(overrides), model)
        arms.append({"name": name, "overrides": dict(overrides), "points": points,
                     "capacity_rps": capacity(points)})
    labels = {p["evidence"] for a in arms for p in a["points"]}
    if len(labels) != 1:
        raise ValueError(f"evidence labels mixed in one study: {sorted(labels)}")
    first, second = arms[0]["capacity_rps"], arms[1]["capacity_rps"]
    ratio = first / second if first and second else None
    for a in arms:
        print(f"capacity {a['name']:20s} {a['capacity_rps']} req/s")
    print(f"ratio {arms[0]['name']} / {arms[1]['name']}: {ratio if ratio is None else round(ratio, 2)}"
          f"  (SLO: p99 TTFT <= {c.ttft_slo_ms} ms, p99 TPOT <= {c.tpot_slo_ms} ms)")
    common.write_json(out_dir / "capacity.json", {
        "study": "capacity", "evidence": labels.pop(), "config": c.to_dict(), "arms": arms,
        "capacity_ratio": ratio, "provenance": common.provenance()})
    if c.plots:
        plots.capacity_curves(arms, c.ttft_slo_ms, c.tpot_slo_ms, out_dir / "capacity.png")
    print(f"wrote {out_dir}/capacity.json")


def _f(v) -> str:
    return "-" if v is None else f"{v:8.1f}"


if __name__ == "__main__":
    app.run(main)
