"""What-if study: serving capacity on modelled H200s, in simulation (``evidence: simulated``).

The simulator (``paged.sim``) runs the real scheduler, block manager, input batch and read-back
per replica; the device is ``RooflineStepModel(H200, model)``: weights and KV bytes over the
bandwidth, FLOPs over the FLOP rate, plus the host time measured on the H200 machine (figures
and their sources in ``paged.sim.specs.H200``). Models are dimensions only (Llama-3-8B,
Qwen2.5-7B), bfloat16 weights and KV.

Capacity under the SLO (``capacity``): the highest request rate at which every request finishes
(by ``max_time_factor * duration_s + 30`` simulated seconds) with p99 TTFT and p99 TPOT within the
SLO; found by bracketing ``[rate_lo, rate_hi]`` (for more replicas: half to 1.5 times the smallest
count's capacity per replica, times the count) and bisecting ``bisect_steps`` times (the same
requests at every rate: one seed, arrivals scaled). Studies: block size,
``max_num_batched_tokens``, preemption mode (each at ``tight_kv_gb`` of KV), replicas x router on a
multi-tenant workload (``num_prefixes`` shared prefixes of ``prefix_len`` tokens, one per tenant,
tenants uniform), and the simulator's own speed (wall time per simulated request against N).

This module is the study's entry (``check``, ``main``); the helpers it shares with
``fleet_traces.py`` and ``fleet_whatifs.py`` live in ``fleet_sweep.py``.
"""

from __future__ import annotations

import dataclasses
import os

from experiments import common, fleet_traces, fleet_whatifs
from experiments.fleet_sweep import (  # noqa: F401 (re-exported: the studies' helpers)
    WithChanges,
    capacity,
    device,
    engine_for,
    fmt,
    meets,
    plain_workload,
    records_sha256,
    run_point,
    sweep,
    tenant_workload,
)
from paged.fleet.routing import POLICIES, Router
from paged.sim import EVIDENCE, RooflineStepModel, Simulator, check_not_mixed
from paged.sim.specs import MODELS

STUDIES = ("block_size", "batched_tokens", "preemption", "replicas", "speed", "point", "traces",
           "kv_dtype", "window", "cascade")  # the last three: experiments/fleet_whatifs.py
WORKLOADS = ("tenants", "plain")


def check(c) -> dict:
    unknown = sorted((set(c.models) | set(c.replica_models)) - set(MODELS))
    if unknown or not c.models:
        raise ValueError(f"models={tuple(c.models)}: unknown {unknown}; known: {sorted(MODELS)}")
    if c.bandwidth not in ("copy", "datasheet"):
        raise ValueError(f"bandwidth={c.bandwidth!r} must be 'copy' (measured 3.1 TB/s) or "
                         "'datasheet' (4.8 TB/s)")
    bad = sorted(set(c.studies) - set(STUDIES))
    if bad or not c.studies:
        raise ValueError(f"studies={tuple(c.studies)}: unknown {bad}; known: {STUDIES}")
    bad = sorted(set(c.routers) - set(POLICIES))
    if bad:
        raise ValueError(f"routers={tuple(c.routers)}: unknown {bad}; known: {POLICIES}")
    common.check_positive(ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms,
                          duration_s=c.duration_s, replica_duration_s=c.replica_duration_s, max_time_factor=c.max_time_factor,
                          rate_lo=c.rate_lo, rate_hi=c.rate_hi, kv_gb=c.kv_gb,
                          tight_kv_gb=c.tight_kv_gb, speed_rate_per_replica=c.speed_rate_per_replica)
    common.check_positive(point_rate=c.point_rate)
    if isinstance(c.point_replicas, bool) or not isinstance(c.point_replicas, int) \
            or not 1 <= c.point_replicas <= 1024:
        raise ValueError(f"point_replicas={c.point_replicas!r} must be an int in [1, 1024]")
    if c.point_router not in POLICIES:
        raise ValueError(f"point_router={c.point_router!r}: known: {POLICIES}")
    if c.point_workload not in WORKLOADS:
        raise ValueError(f"point_workload={c.point_workload!r}: known: {WORKLOADS}")
    if c.rate_hi <= c.rate_lo:
        raise ValueError(f"rate_hi={c.rate_hi} must exceed rate_lo={c.rate_lo}")
    for key in ("block_sizes", "batched_tokens", "replicas", "speed_requests"):
        vals = tuple(c[key])
        if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
            raise ValueError(f"{key}={vals!r} must be a non-empty tuple of ints >= 1")
    if max(c.replicas) > 1024:
        raise ValueError(f"replicas={tuple(c.replicas)}: at most 1024")
    base = common.make_engine_config(c.engine, model="sim")
    if c.prefix_len + 2 > base.max_model_len:
        raise ValueError(f"prefix_len={c.prefix_len} leaves no room in max_model_len="
                         f"{base.max_model_len}")
    for b in c.block_sizes:
        dataclasses.replace(base, block_size=b)
    for t in c.batched_tokens:
        dataclasses.replace(base, max_num_batched_tokens=t)
    plan = {"base": base, "whatifs": fleet_whatifs.check(c, base)}
    if "traces" in c.studies:
        plan["traces"] = fleet_traces.check(c, base)
    return plan


def speed(c, cfg, sm, replicas: int) -> list[dict]:
    """Wall time per simulated request at each ``speed_requests`` size (fast-forward on, as in
    every study), and, with ``speed_compare_stepping``, the smallest size stepped one step per
    host pass too: the same records (compared), the wall time it takes."""
    rows = []
    rate = c.speed_rate_per_replica * replicas
    sizes = [(n, True) for n in c.speed_requests]
    if c.speed_compare_stepping:
        sizes.insert(0, (min(c.speed_requests), False))
    for n, ff in sizes:
        w = plain_workload(c, n, rate, cfg.max_model_len)
        sim = Simulator(cfg, sm, num_replicas=replicas, router=Router("least_loaded"),
                        model_config=sm.model, build_device=False, fast_forward=ff)
        res = sim.run(w)
        s = res.summary
        tokens = s["total_output_tokens"]
        fast = sum(r["num_fast_forward_steps"] for r in res.replicas)
        rows.append({"num_requests": n, "replicas": replicas, "rate": rate, "wall_s": res.wall_s,
                     "fast_forward": ff, "fast_forward_steps": fast,
                     "us_per_request": 1e6 * res.wall_s / n,
                     "requests_per_wall_s": n / res.wall_s, "cpu_s": res.cpu_s,
                     "us_cpu_per_request": 1e6 * res.cpu_s / n,
                     "requests_per_cpu_s": n / res.cpu_s,
                     "output_tokens": tokens, "us_per_output_token": 1e6 * res.wall_s / tokens,
                     "num_steps": res.num_steps, "us_per_step": 1e6 * res.wall_s / res.num_steps,
                     "records_sha256": records_sha256(res), "load_average": os.getloadavg()[0],
                     "sim_s": res.sim_s, "completed": s["completed"], "evidence": s["evidence"]})
        r = rows[-1]
        print(f"  speed {replicas} replicas  N={n:7d}  {'fast-forward' if ff else 'stepping    '}"
              f"  wall {r['wall_s']:7.2f} s  {r['us_per_request']:8.1f} us/request  "
              f"{r['requests_per_wall_s']:8.0f} req/s (CPU {r['cpu_s']:.2f} s: "
              f"{r['requests_per_cpu_s']:.0f} req/CPU-s)  {r['us_per_output_token']:.2f} us/token  "
              f"{r['us_per_step']:.1f} us/step  ({fast / res.num_steps:.0%} of steps fast-forwarded)",
              flush=True)
    if c.speed_compare_stepping:
        same = rows[0]["records_sha256"] == rows[1]["records_sha256"]
        print(f"  stepping and fast-forward give {'the same' if same else 'DIFFERENT'} records; "
              f"speed-up {rows[0]['wall_s'] / rows[1]['wall_s']:.1f}x", flush=True)
        if not same:
            raise RuntimeError("fast-forward changed the simulated records")
    return rows


def point(c, cfg, sm) -> dict:
    """One what-if: ``point_replicas`` replicas behind ``point_router`` at ``point_rate`` req/s
    (``rate * duration_s`` requests, at most ``max_requests``) of the ``point_workload``."""
    make_wl = tenant_workload if c.point_workload == "tenants" else plain_workload
    p = run_point(c, cfg, sm, make_wl, c.point_rate, replicas=c.point_replicas,
                  router=c.point_router)
    s = p["summary"]
    p.update(replicas=c.point_replicas, router_policy=c.point_router, workload=c.point_workload,
             block_size=cfg.block_size, num_blocks_per_replica=cfg.num_blocks)
    hit = s["prefix_cache_hit_rate"]
    print(f"  {sm.model.name}: {c.point_replicas} x H200, {c.point_router}, "
          f"block_size={cfg.block_size}, {c.point_rate:g} req/s ({c.point_workload}): "
          f"{s['completed']}/{s['num_requests']} finished; TTFT p50 / p99 {fmt(s['median_ttft_ms'], '.1f')}"
          f" / {fmt(s['p99_ttft_ms'], '.1f')} ms; TPOT p50 / p99 {fmt(s['median_tpot_ms'], '.1f')} / "
          f"{fmt(s['p99_tpot_ms'], '.1f')} ms; {s['output_throughput'] or 0:.0f} output tok/s; "
          f"prefix hit rate {'-' if hit is None else f'{hit:.0%}'}; "
          f"{'meets' if p['meets_slo'] else 'misses'} the SLO (p99 TTFT <= {c.ttft_slo_ms:g} ms, "
          f"p99 TPOT <= {c.tpot_slo_ms:g} ms); simulated in {p['wall_s']:.1f} s", flush=True)
    return p


def main(c, plan):
    out_dir = common.output_dir(c, "fleet")

    base, dev = plan["base"], device(c)
    results = {}
    for name in (c.models if set(c.studies) - {"traces", *fleet_whatifs.WHATIFS} else ()):
        model = MODELS[name]
        res = results[name] = {}
        def tight(model=model, **o):
            return engine_for(base, model, c.tight_kv_gb, **o)

        # The engine's KV storage (kv_cache_dtype): quantized bytes read, values + scales.
        sm = RooflineStepModel(dev, model.with_kv_cache(base), block_size=base.block_size)
        if "block_size" in c.studies:
            arms = [(f"block_size={b}", tight(block_size=b), "least_loaded") for b in c.block_sizes]
            res["block_size"] = []
            for arm in arms:  # the model counts CoW pages by the arm's block size
                bsm = RooflineStepModel(dev, model.with_kv_cache(arm[1]),
                                        block_size=arm[1].block_size)
                res["block_size"] += sweep(c, "block_size", model, bsm, [arm], plain_workload)
        if "batched_tokens" in c.studies:
            arms = [(f"max_num_batched_tokens={t}", tight(max_num_batched_tokens=t), "least_loaded")
                    for t in c.batched_tokens]
            res["batched_tokens"] = sweep(c, "batched_tokens", model, sm, arms, plain_workload)
        if "preemption" in c.studies:
            arms = [(f"preemption_mode={m}", tight(preemption_mode=m), "least_loaded")
                    for m in ("recompute", "swap")]
            res["preemption"] = sweep(c, "preemption", model, sm, arms, plain_workload)
        if "replicas" in c.studies and name in c.replica_models:
            cfg = engine_for(base, model, c.kv_gb)
            res["replicas"] = []
            bracket = None
            for n in sorted(c.replicas):
                routers = c.routers if n > 1 else ("least_loaded",)
                arms = [(f"{n}x {r}", cfg, r) for r in routers]
                res["replicas"] += sweep(c, "replicas", model, sm, arms, tenant_workload,
                                          replicas=n, bracket=bracket,
                                          duration_s=c.replica_duration_s)
                caps = [a["capacity_rps"] for a in res["replicas"][-len(arms):] if a["capacity_rps"]]
                if bracket is None and caps:  # later counts search around the per-replica figure
                    per = max(caps) / n
                    bracket = (0.5 * per, 1.5 * per)
        if "speed" in c.studies and name in c.replica_models:
            res["speed"] = speed(c, engine_for(base, model, c.kv_gb), sm, max(c.replicas))
        if "point" in c.studies:
            res["point"] = point(c, engine_for(base, model, c.kv_gb), sm)
    for study, arms in plan["whatifs"].items():  # KV format what-ifs, per model
        for name, rows in fleet_whatifs.run(c, study, arms, dev).items():
            results.setdefault(name, {})[study] = rows
    traces = None
    if "traces" in c.studies:
        traces = fleet_traces.run(c, plan["traces"])
    labels = [{"evidence": p["evidence"]} for m in results.values() for k, v in m.items()
              if k not in ("speed", "point") for a in v for p in a["points"]]
    labels += [{"evidence": p["evidence"]} for t in (traces or {}).values() for a in t["arms"]
               for p in a["points"]]
    labels += [{"evidence": r["evidence"]} for m in results.values() for r in m.get("speed", [])]
    labels += [{"evidence": m["point"]["evidence"]} for m in results.values() if "point" in m]
    label = check_not_mixed(labels) if labels else EVIDENCE
    path = common.write_result(out_dir / "fleet.json", {
        "study": "fleet", "evidence": label, "device": dataclasses.asdict(dev),
        "models": {n: dataclasses.asdict(MODELS[n]) for n in dict.fromkeys((*c.models, *results))},
        "slo": {"p99_ttft_ms": c.ttft_slo_ms, "p99_tpot_ms": c.tpot_slo_ms},
        "results": results, **({"traces": traces, "traces_slo": {
            "p99_ttft_ms": c.trace_ttft_slo_ms, "p99_tpot_ms": c.trace_tpot_slo_ms}}
            if traces is not None else {}),
        "config": c.to_dict(), "provenance": {**common.provenance(),
                                              "load_average": list(os.getloadavg())}})
    if plan["whatifs"] and c.plots:
        fleet_whatifs.plot(results, (c.ttft_slo_ms, c.tpot_slo_ms), out_dir)
    if traces is not None and c.plots:
        fleet_traces.plot(traces, (c.trace_ttft_slo_ms, c.trace_tpot_slo_ms), out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    common.run("fleet", main, check)
