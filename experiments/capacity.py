"""Capacity study: request-rate sweep per arm, the highest rate within the SLO, and the ratio.

With ``workload.azure`` (``code`` / ``conv``) the points are one window of a real Azure trace
(``evidence: real``; lengths scaled to ``max_model_len``) time-scaled to each rate of the grid
(``time_scale = window's mean rate / rate``, recorded per point): the real arrival process at
several speeds, its burstiness kept, rather than ``rate * duration_s`` constructed requests.

With ``kv_budget_bytes`` > 0 the KV format is a factor: every arm's pool is the blocks that one
byte budget holds in the arm's own format (``kv_cache_dtype``, ``kv_scale_granularity``: values
plus scales, `experiments.kv_budget`), recorded per arm under ``pool``. With ``probe.num_seqs`` > 0
each arm's decode step is also timed at one fixed batch (`experiments.decode_probe`), so that a
capacity gap can be told apart from a gap in step cost.

Writes ``capacity.json`` (every point's summary, the capacities, the ratio) and ``capacity.png``
(p99 TTFT and p99 TPOT against the rate, the SLOs drawn in) and ``replay.json`` (one record per
point, arm ``<arm>@<rate>``, each on a new engine: ``python -m experiments.replay --from=<dir>``).
"""

from __future__ import annotations

import os

import ml_collections

from experiments import common, decode_probe, kv_budget, plots, serving
from experiments.replay import replay_command
from paged.workload.workload import check_same_evidence


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


def point_workload(c, rate: float, real=None):
    """The workload of one grid point: ``rate * duration_s`` requests at ``rate``, or the real
    window ``real`` time-scaled to a mean of ``rate``."""
    if real is not None:
        return real.time_scaled(len(real) / real.duration_s / rate)
    w = ml_collections.ConfigDict(c.workload.to_dict())
    w.rate = float(rate)
    w.num_requests = max(2, round(rate * c.duration_s))
    return serving.build_workload(w, c.engine.max_model_len)


def check(c) -> dict:
    """Checks every setting; builds every arm's EngineConfig and every point's workload."""
    serving.check_serving(c)
    engines = serving.check_arms(c)
    if not engines:
        raise ValueError("config.arms names no arm")  # one arm: no ratio (a piece of a grid)
    if c.workload.trace:
        raise ValueError(f"workload.trace={c.workload.trace!r}: capacity sweeps the arrival rate "
                         "of a constructed workload; serve a trace with experiments.serve")
    if not c.rates:
        raise ValueError("rates=() names no rate")
    common.check_positive(duration_s=c.duration_s, max_drain_s=c.max_drain_s,
                          **{f"rates[{i}]": r for i, r in enumerate(c.rates)})
    if isinstance(c.stop_after_failures, bool) or c.stop_after_failures < 1:
        raise ValueError(f"stop_after_failures={c.stop_after_failures!r} must be an integer >= 1")
    real = None
    if c.workload.get("azure", ""):
        if c.workload.time_scale != 1.0:
            raise ValueError(f"workload.time_scale={c.workload.time_scale!r}: capacity scales the "
                             "real window to each rate of config.rates; leave it 1")
        real = serving.real_workload(c.workload, c.engine.max_model_len, time_scale=False)
        if len(real) < 2 or real.duration_s <= 0:
            raise ValueError(f"workload.window={tuple(c.workload.window)!r} holds {len(real)} "
                             "requests: too few to scale")
    workloads = {float(rate): point_workload(c, rate, real) for rate in c.rates}
    check_same_evidence(list(workloads.values()), swept=("time_scale",))
    return {"engines": engines, "workloads": workloads, **check_kv_budget(c, engines)}


def check_kv_budget(c, engines) -> dict:
    """With ``kv_budget_bytes``: every arm's pool sized from it (``engines`` replaced, ``pools``
    per arm); the probe's shape checked. Without: nothing changes."""
    common.check_unset(c.engine, ("num_blocks",) if c.kv_budget_bytes else (), "kv_budget_bytes")
    if c.probe.num_seqs:
        common.check_positive(**{f"probe.{k}": c.probe[k] for k in ("prompt_len", "steps")})
        for name, cfg in engines:
            if c.probe.num_seqs > cfg.max_num_seqs or (
                    c.probe.prompt_len + c.probe.steps + 3 > cfg.max_model_len):
                raise ValueError(f"probe (num_seqs={c.probe.num_seqs}, prompt_len="
                                 f"{c.probe.prompt_len}, steps={c.probe.steps}) does not fit arm "
                                 f"{name!r} (max_num_seqs={cfg.max_num_seqs}, max_model_len="
                                 f"{cfg.max_model_len})")
    if not c.kv_budget_bytes:
        if c.kv_budget_priced_as:
            raise ValueError(f"kv_budget_priced_as={tuple(c.kv_budget_priced_as)!r} needs "
                             "kv_budget_bytes > 0")
        return {}
    common.check_positive(kv_budget_bytes=c.kv_budget_bytes)
    priced = kv_budget.check_priced_as(c.kv_budget_priced_as, engines, "kv_budget_priced_as")
    sized = kv_budget.size_arms(engines, common.load_model(c.model)[0], int(c.kv_budget_bytes),
                                priced)
    return {"engines": [(name, cfg) for name, cfg, _ in sized],
            "pools": {name: pool for name, _, pool in sized}}


def point_summary(summary: dict) -> dict:
    """A point's summary as stored: every scalar, without vLLM's per-request arrays
    (`paged.workload.metrics.per_request_arrays`; the ITLs alone are about 1 MB a point at 64 req/s)."""
    return {k: v for k, v in summary.items() if not isinstance(v, list)}


def sweep_arm(c, name: str, engine_config, workloads: dict, model, replays=None,
              extra=None) -> list[dict]:
    """One arm's points, a new engine each (``replays``: gets each point's replay record;
    ``extra(engine)``: more fields for each point, read from its engine after the run)."""
    points, misses = [], 0
    for rate, workload in workloads.items():
        engine = serving.build_engine(engine_config, model)
        res = serving.run_arm(f"{name}@{rate:g}", engine, workload, ttft_slo_ms=c.ttft_slo_ms,
                              tpot_slo_ms=c.tpot_slo_ms,
                              max_wall_s=workload.duration_s + c.max_drain_s, progress="tty",
                              model_name=c.model)
        ok = meets_slo(res.summary, c.ttft_slo_ms, c.tpot_slo_ms)
        if replays is not None:
            replays.append(res.replay)
        points.append({"rate": float(rate), "meets_slo": ok,
                       "summary": point_summary(res.summary),
                       "evidence": workload.evidence, "label": workload.label(),
                       "derived": workload.meta.get("derived", []), "wall_s": res.wall_s,
                       **(extra(engine) if extra else {})})
        s = res.summary
        print(f"  {name:20s} rate {rate:5.2f}/s  p99 TTFT {_f(s.get('p99_ttft_ms'))} ms  p99 TPOT "
              f"{_f(s.get('p99_tpot_ms'))} ms  completed {s['completed']}/{s['num_requests']}  "
              f"{'OK' if ok else 'miss'}", flush=True)
        misses = 0 if ok else misses + 1
        if misses >= c.stop_after_failures:
            break
    return points


def main(c, plan):
    out_dir = common.output_dir(c, "capacity")
    model = common.load_model(c.model)
    arms, replays = [], []
    for name, engine_config in plan["engines"]:
        overrides = dict(dict(c.arms)[name])
        extra = {"load_before": os.getloadavg()}
        if name in plan.get("pools", {}):
            extra["pool"] = plan["pools"][name]
        if c.probe.num_seqs:
            extra["decode_probe"] = decode_probe.decode_step_time(
                engine_config, model, num_seqs=c.probe.num_seqs, prompt_len=c.probe.prompt_len,
                steps=c.probe.steps)
            print(f"  {name:20s} decode step ({c.probe.num_seqs} seqs, prompt "
                  f"{c.probe.prompt_len}): {extra['decode_probe']['median_step_ms']:.2f} ms",
                  flush=True)
        points = sweep_arm(c, name, engine_config, plan["workloads"], model, replays)
        arms.append({"name": name, "overrides": overrides, "points": points,
                     "capacity_rps": capacity(points), **extra, "load_after": os.getloadavg()})
    label = check_same_evidence([{"evidence": p["evidence"], "derived": p["derived"],
                                  "name": f"{a['name']}@{p['rate']}"}
                                 for a in arms for p in a["points"]], swept=("time_scale",))
    first = arms[0]["capacity_rps"]
    second = arms[1]["capacity_rps"] if len(arms) > 1 else None
    ratio = first / second if first and second else None
    for a in arms:
        pool = a.get("pool")
        pool = f"  ({pool['num_blocks']} blocks of {pool['kv_format']})" if pool else ""
        print(f"capacity {a['name']:20s} {a['capacity_rps']} req/s{pool}")
    print(f"ratio {arms[0]['name']} / {arms[-1]['name']}: {ratio if ratio is None else round(ratio, 2)}"
          f"  (SLO: p99 TTFT <= {c.ttft_slo_ms} ms, p99 TPOT <= {c.tpot_slo_ms} ms)")
    common.write_result(out_dir / "capacity.json", {
        "study": "capacity", "evidence": label, "config": c.to_dict(), "arms": arms,
        "capacity_ratio": ratio, "provenance": common.provenance()})
    if c.plots:
        plots.capacity_curves(arms, c.ttft_slo_ms, c.tpot_slo_ms, out_dir / "capacity.png")
    print(f"wrote {out_dir}/capacity.json")
    if serving.write_replay_records(out_dir / "replay.json", replays):
        print(f"replay: {replay_command(out_dir)}")


def _f(v) -> str:
    return "-" if v is None else f"{v:8.1f}"


if __name__ == "__main__":
    common.run("capacity", main, check)
