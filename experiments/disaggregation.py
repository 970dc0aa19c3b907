"""Study: prefill and decode on different replicas, against colocated replicas, in simulation.

Evidence: ``simulated`` (``paged.sim``: the real scheduler and block manager per replica, the
``RooflineStepModel`` of one H200 per replica, ``paged.sim.disagg`` for the hand-overs) over
``real`` traces (the Azure LLM inference traces 2023, ``paged.workload.workload.load_azure_trace``; a window,
lengths clipped, synthetic prompt ids; every derivation in the workload's label).

For each trace, fleet of G GPUs (with its link) and offered rate, the colocated arm (G full
replicas behind a least-loaded router) and every split P:D (P prefill-only replicas, D = G - P
decode-only ones, each prompt's KV handed over at ``M_KV`` bytes over the link) serve the same
time-scaled trace. Per run and per SLO pair: SLO attainment (requests finished with TTFT and TPOT
within bounds, over all requests). Goodput per GPU, DistServe's form: the highest per-GPU rate of
the grid at which attainment >= ``attainment``; the best split against colocated, per trace, G and
SLO. Writes ``disaggregation.json`` (every point, provenance, machine load) and the plots to
``output_dir``. Config: ``experiments/configs/disaggregation.py``.
"""

from __future__ import annotations

import dataclasses
import os
import time

from experiments import common, fleet_sweep
from paged.fleet.routing import POLICIES, Router
from paged.sim import EVIDENCE, H200, RooflineStepModel, Simulator
from paged.sim.link_transport import LINKS, LinkTransport
from paged.sim.specs import MODELS
from paged.workload import metrics
from paged.workload.workload import AZURE_TRACES, check_same_evidence

KEEP = ("completed", "num_requests", "num_aborted", "num_timeout", "num_rejected",
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "engine_preemptions",
        "num_handovers", "kv_transfer_bytes", "mean_transfer_ms", "p99_transfer_ms",
        "mean_handover_wait_ms", "p99_handover_wait_ms", "duration")


def check(c) -> dict:
    """Validates every setting; builds the traces, the engine config, the step model and each
    fleet's hand-over."""
    if c.model not in MODELS:
        raise ValueError(f"model={c.model!r}; known: {sorted(MODELS)}")
    bad = [s for s in c.services if s not in AZURE_TRACES]
    if bad or not c.services:
        raise ValueError(f"services={tuple(c.services)}: unknown {bad}; known: {AZURE_TRACES}")
    common.check_positive(hbm_gb=c.hbm_gb, memory_utilization=c.memory_utilization,
                          max_time_factor=c.max_time_factor, subsample=c.subsample,
                          attainment=c.attainment)
    if c.memory_utilization > 1 or c.subsample > 1 or c.attainment > 1:
        raise ValueError(f"memory_utilization={c.memory_utilization}, subsample={c.subsample}, "
                         f"attainment={c.attainment}: each must be in (0, 1]")
    if c.router not in POLICIES:
        raise ValueError(f"router={c.router!r}; known: {POLICIES}")
    fleets = []
    for item in c.gpus:
        try:
            g, link = item
        except (TypeError, ValueError):
            raise ValueError(f"gpus item {item!r} must be a (GPUs, link) pair") from None
        if isinstance(g, bool) or not isinstance(g, int) or g < 2:
            raise ValueError(f"gpus: {g!r} must be an int >= 2 (a prefill and a decode replica)")
        if link not in LINKS:
            raise ValueError(f"gpus: link {link!r}; known: {sorted(LINKS)}")
        fleets.append((g, link))
    if not fleets:
        raise ValueError("gpus=() names no fleet")
    rates = dict(c.rates_per_gpu)
    for s in c.services:
        r = tuple(rates.get(s, ()))
        if not r or any(not isinstance(x, (int, float)) or x <= 0 for x in r):
            raise ValueError(f"rates_per_gpu for {s!r}: {r!r} must be a non-empty tuple of "
                             "positive rates")
    slos = [tuple(map(float, p)) for p in c.slos]
    if not slos or any(len(p) != 2 or min(p) <= 0 for p in slos):
        raise ValueError(f"slos={tuple(c.slos)!r} must be (TTFT ms, TPOT ms) pairs > 0")
    window = tuple(c.window)
    if window and len(window) != 2:
        raise ValueError(f"window={window!r} must be () or (start_s, end_s)")
    dims = MODELS[c.model]
    base = common.make_engine_config(c.engine, model="sim", max_model_len=c.max_model_len)
    dims = dims.with_kv_cache(base)
    held = dims.weight_bytes + dims.d_model * dims.vocab_size * dims.bytes_per_param  # + embedding
    kv = c.memory_utilization * c.hbm_gb * 1e9 - held
    if kv <= 0:
        raise ValueError(f"{c.model} weights ({held / 1e9:.1f} GB) fill {c.hbm_gb} GB at "
                         f"memory_utilization={c.memory_utilization}")
    cfg = dataclasses.replace(base, num_blocks=dims.num_blocks(kv, base.block_size))
    sm = RooflineStepModel(H200, dims, block_size=cfg.block_size)
    traces = {s: fleet_sweep.trace_to_scale(
        s, window=window, subsample=c.subsample, seed=c.seed, max_model_len=c.max_model_len,
        prompt_seed=c.prompt_seed) for s in c.services}
    return {"traces": traces, "rates": {s: tuple(map(float, rates[s])) for s in c.services},
            "fleets": fleets, "slos": slos, "config": cfg, "step_model": sm, "kv_bytes": kv,
            "handovers": {g: LinkTransport(LINKS[link], dims) for g, link in fleets}}


def arms(g: int) -> list[int]:
    """Prefill replicas per arm: 0 (colocated), then every split 1 .. g - 1."""
    return list(range(g))


def run_point(c, plan, base, g: int, p: int, rate_per_gpu: float) -> dict:
    """One simulated run: ``g`` GPUs, ``p`` of them prefill-only (0: colocated), the trace
    time-scaled to ``rate_per_gpu * g`` req/s."""
    rate = rate_per_gpu * g
    w = base.time_scaled(len(base) / base.duration_s / rate)
    kw = {"prefill_replicas": p, "handover": plan["handovers"][g]} if p else {}
    sim = Simulator(plan["config"], plan["step_model"], num_replicas=g,
                    router=Router(c.router), model_config=plan["step_model"].model,
                    build_device=False, **kw)
    res = sim.run(w, max_time_s=c.max_time_factor * w.duration_s + 30.0)
    n = len(res.records)
    attain = {}
    for ttft, tpot in plan["slos"]:
        good = sum(metrics.meets_slo(r, ttft_slo_ms=ttft, tpot_slo_ms=tpot) for r in res.records)
        attain[f"{ttft:g}/{tpot:g}"] = good / n
    s = res.summary
    busy = [r["busy_s"] / max(res.sim_s, 1e-9) for r in res.replicas]
    return {"gpus": g, "prefill": p, "decode": g - p if p else 0, "rate_per_gpu": rate_per_gpu,
            "rate": rate, "attainment": attain, "summary": {k: s.get(k) for k in KEEP},
            "busy_fraction": {"prefill": _mean(busy[:p]) if p else None,
                              "decode": _mean(busy[p:]) if p else None,
                              "colocated": None if p else _mean(busy)},
            "evidence": s["evidence"], "workload_evidence": w.evidence,
            "derived": w.meta["derived"], "wall_s": res.wall_s, "cpu_s": res.cpu_s}


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def goodput_per_gpu(points: list[dict], slo: str, target: float) -> float | None:
    """DistServe's goodput per GPU: the highest per-GPU rate tried with attainment >= target
    (None: none met it)."""
    ok = [p["rate_per_gpu"] for p in points if p["attainment"][slo] >= target]
    return max(ok) if ok else None


def compare(points: list[dict], slos: list[str], target: float) -> list[dict]:
    """Per SLO: colocated goodput per GPU, the best split's, their ratio, and per rate the arm
    with the highest attainment."""
    by_arm: dict[int, list] = {}
    for p in points:
        by_arm.setdefault(p["prefill"], []).append(p)
    out = []
    for slo in slos:
        gp = {arm: goodput_per_gpu(ps, slo, target) for arm, ps in by_arm.items()}
        splits = {a: v for a, v in gp.items() if a}
        best = max(splits, key=lambda a: (splits[a] or 0.0, -a)) if splits else None
        colo, dis = gp.get(0), splits.get(best)
        per_rate = []
        for r in sorted({p["rate_per_gpu"] for p in points}):
            at = {p["prefill"]: p["attainment"][slo] for p in points if p["rate_per_gpu"] == r}
            top = max((a for a in at if a), key=lambda a: (at[a], -a))
            per_rate.append({"rate_per_gpu": r, "colocated": at.get(0), "best_split":
                             f"{top}:{points[0]['gpus'] - top}", "best_split_attainment": at[top]})
        out.append({"slo": slo, "goodput_per_gpu": {("colocated" if a == 0 else
                                                      f"{a}:{points[0]['gpus'] - a}"): v
                                                     for a, v in sorted(gp.items())},
                    "colocated": colo, "best_split": best and f"{best}:{points[0]['gpus'] - best}",
                    "best_split_goodput": dis,
                    "ratio": dis / colo if dis and colo else None, "per_rate": per_rate})
    return out


def main(c, plan) -> dict:
    out_dir = common.output_dir(c, "disaggregation")
    slo_keys = [f"{a:g}/{b:g}" for a, b in plan["slos"]]
    total = sum(len(plan["rates"][s]) * len(arms(g)) for s in plan["traces"]
                for g, _ in plan["fleets"])
    t0 = time.perf_counter()
    results = {}
    with common.Progress(total, "[disaggregation]", unit="runs", lines=True) as bar:
        for service, base in plan["traces"].items():
            fleets = []
            for g, link in plan["fleets"]:
                points = []
                for rate in plan["rates"][service]:
                    for p in arms(g):
                        points.append(run_point(c, plan, base, g, p, rate))
                        bar.set(bar.n + 1, trace=service, gpus=g,
                                arm=f"{p}:{g - p}" if p else "colocated", rate=rate)
                check_same_evidence([{"evidence": q["workload_evidence"], "derived": q["derived"],
                                      "name": f"{q['prefill']}@{q['rate']:g}"} for q in points],
                                    swept=("time_scale",))
                cmp = compare(points, slo_keys, c.attainment)
                fleets.append({"gpus": g, "link": plan["handovers"][g].link.name,
                               "points": points, "comparison": cmp})
                for row in cmp:
                    print(f"  {service} {g} GPUs ({link}) SLO {row['slo']} ms: goodput/GPU "
                          f"colocated {common_fmt(row['colocated'])}, best split "
                          f"{row['best_split']} {common_fmt(row['best_split_goodput'])} req/s "
                          f"(ratio {common_fmt(row['ratio'])})", flush=True)
            results[service] = {"label": base.label(), "meta": base.meta,
                                "natural_rate_rps": len(base) / base.duration_s,
                                "fleets": fleets}
    payload = {"study": "disaggregation", "evidence": EVIDENCE, "workload_evidence": "real",
               "model": c.model, "engine": dataclasses.asdict(plan["config"]),
               "kv_bytes_per_gpu": plan["kv_bytes"], "step_model": plan["step_model"].describe(),
               "handovers": {str(g): h.describe() for g, h in plan["handovers"].items()},
               "slos_ms": plan["slos"], "attainment_target": c.attainment,
               "config": c.to_dict(), "results": results, "wall_s": time.perf_counter() - t0,
               "load_average": os.getloadavg(), "provenance": common.provenance()}
    common.write_result(out_dir / "disaggregation.json", payload)
    if c.plots:
        from experiments.disaggregation_plots import plot

        plot(payload, out_dir)
    print(tables(payload), flush=True)
    print(f"wrote {out_dir / 'disaggregation.json'}", flush=True)
    return payload


def combine(payloads: list[dict]) -> dict:
    """Several runs of this study over the same traces, fleets and SLOs (different rate grids)
    as one payload: points pooled (a rate in two runs is taken from the first), comparisons
    recomputed. Refuses runs whose workload labels or engines differ."""
    first = payloads[0]
    out = {**first, "results": {}, "combined_from": [p["provenance"] for p in payloads]}
    for service, res in first["results"].items():
        fleets = []
        for k, fleet in enumerate(res["fleets"]):
            points, seen = [], set()
            for p in payloads:
                other = p["results"][service]
                if other["label"] != res["label"] or p["engine"] != first["engine"]:
                    raise ValueError(f"{service}: runs of different workloads or engines")
                for q in other["fleets"][k]["points"]:
                    key = (q["prefill"], q["rate_per_gpu"])
                    if key not in seen:
                        seen.add(key)
                        points.append(q)
            slos = [row["slo"] for row in fleet["comparison"]]
            fleets.append({**fleet, "points": points,
                           "comparison": compare(points, slos, first["attainment_target"])})
        out["results"][service] = {**res, "fleets": fleets}
    return out


def tables(payload: dict) -> str:
    """Markdown tables of a payload: per trace, fleet and SLO, goodput per GPU colocated against
    the best split; then, per rate, colocated attainment against the best split's."""
    lines = [("| trace | GPUs (link) | SLO TTFT/TPOT ms | goodput/GPU colocated | best split | "
             "its goodput/GPU | ratio |"), "| --- | --- | --- | --- | --- | --- | --- |"]
    rates = ["", ("| trace | GPUs | SLO | rate/GPU | colocated attainment | best split | "
             "its attainment |"), "| --- | --- | --- | --- | --- | --- | --- |"]
    for service, res in payload["results"].items():
        for fleet in res["fleets"]:
            for row in fleet["comparison"]:
                lines.append(f"| {service} | {fleet['gpus']} ({fleet['link']}) | {row['slo']} | "
                             f"{common_fmt(row['colocated'])} | {row['best_split']} | "
                             f"{common_fmt(row['best_split_goodput'])} | "
                             f"{common_fmt(row['ratio'])} |")
                for r in row["per_rate"]:
                    rates.append(f"| {service} | {fleet['gpus']} | {row['slo']} | "
                                 f"{r['rate_per_gpu']:g} | {r['colocated']:.3f} | "
                                 f"{r['best_split']} | {r['best_split_attainment']:.3f} |")
    return "\n".join(lines + rates)


def common_fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"


if __name__ == "__main__":
    common.run("disaggregation", main, check)
