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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
import types

import numpy as np

from experiments import common
from paged.fleet.routing import POLICIES, Router
from paged.sim import EVIDENCE, H200, RooflineStepModel, Simulator, check_not_mixed
from paged.sim.specs import H200_DATASHEET_BW, MODELS
from paged.workload.workload import (
    BOS_ID,
    Workload,
    make_workload,
    synthetic_prompt,
)

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
    from experiments import fleet_whatifs

    plan = {"base": base, "whatifs": fleet_whatifs.check(c, base)}
    if "traces" in c.studies:
        from experiments import fleet_traces

        plan["traces"] = fleet_traces.check(c, base)
    return plan


def device(c):
    return H200 if c.bandwidth == "copy" else dataclasses.replace(
        H200, mem_bandwidth=H200_DATASHEET_BW, source=H200.source + "; bandwidth overridden: "
        "datasheet 4.8 TB/s")


def engine_for(base, model, kv_gb: float, **overrides):
    cfg = dataclasses.replace(base, **overrides)
    blocks = model.with_kv_cache(cfg).num_blocks(kv_gb * 1e9, cfg.block_size)  # quantized: more
    return dataclasses.replace(cfg, num_blocks=blocks)


def tenant_workload(c, num: int, rate: float, max_model_len: int) -> Workload:
    """ShareGPT-like requests, each behind one of ``num_prefixes`` tenant prefixes (uniform)."""
    base = make_workload(c.kind, num, rate, max_model_len=max_model_len, seed=c.seed,
                         shared_prefix_len=c.prefix_len)
    rng = np.random.default_rng(c.seed + 7)
    prefixes = [(BOS_ID,) + synthetic_prompt(c.prefix_len, rng=rng) for _ in range(c.num_prefixes)]
    who = rng.integers(0, c.num_prefixes, len(base))
    reqs = tuple(dataclasses.replace(r, prompt_token_ids=prefixes[g] + r.prompt_token_ids[c.prefix_len + 1:])
                 for r, g in zip(base.requests, who.tolist()))
    meta = {**base.meta, "tenants": {"num_prefixes": c.num_prefixes, "prefix_len": c.prefix_len,
                                     "assignment": "uniform", "seed": c.seed + 7}}
    return dataclasses.replace(base, name=f"tenants-{num}", requests=reqs, meta=meta)


def plain_workload(c, num: int, rate: float, max_model_len: int) -> Workload:
    return make_workload(c.kind, num, rate, max_model_len=max_model_len, seed=c.seed)


def meets(summary, c) -> bool:
    if summary["completed"] != summary["num_requests"]:
        return False
    ttft, tpot = summary.get("p99_ttft_ms"), summary.get("p99_tpot_ms")
    return ttft is not None and ttft <= c.ttft_slo_ms and (tpot is None or tpot <= c.tpot_slo_ms)


def run_point(c, cfg, sm, make_wl, rate, replicas=1, router="least_loaded") -> dict:
    num = max(2, min(c.max_requests, round(rate * c.duration_s)))
    w = make_wl(c, num, rate, cfg.max_model_len)
    sim = Simulator(cfg, sm, num_replicas=replicas, router=Router(router, c.load_threshold),
                    model_config=sm.model, build_device=False)
    res = sim.run(w, max_time_s=c.max_time_factor * w.duration_s + 30.0,
                  ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms)
    s = res.summary
    keep = ("completed", "num_requests", "request_throughput", "output_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "request_goodput",
            "engine_preemptions", "prefix_cache_hit_tokens", "prefix_cache_hit_rate",
            "peak_used_blocks", "kv_num_blocks", "num_engine_steps", "max_blocks_per_sequence",
            "recycled_blocks", "cascade_steps", "cascade_prefix_tokens_shared")
    return {"rate": rate, "meets_slo": meets(s, c), "evidence": s["evidence"],
            "summary": {k: s.get(k) for k in keep}, "routed": res.routed, "router": res.router,
            "wall_s": res.wall_s, "sim_s": res.sim_s}


def capacity(c, run) -> tuple[float | None, list[dict]]:
    """Bracket then bisect the highest rate ``run(rate)`` meets the SLO at."""
    points = []

    def ok(rate):
        p = run(rate)
        points.append(p)
        return p["meets_slo"]

    lo, hi = c.rate_lo, c.rate_hi
    for _ in range(4):
        if ok(lo):
            break
        hi, lo = lo, lo / 4
    else:
        return None, points
    for _ in range(3):
        if not ok(hi):
            break
        lo, hi = hi, hi * 2
    else:
        return lo, points  # every rate tried met the SLO: the highest of them
    for _ in range(c.bisect_steps):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, points


def sweep(c, label, model, sm, arms, make_wl, replicas=1, bracket=None, duration_s=None):
    """The capacity of each ``(name, EngineConfig, router)`` arm under step model ``sm`` on
    ``make_wl``'s workload; one row per arm (its points, capacity, wall time)."""
    out = []
    run_c = c if duration_s is None else WithChanges(c, duration_s=duration_s)
    progress = common.Progress(len(arms), f"fleet {model.name} {label}", unit="arm",
                               summary=False)
    for name, cfg, router in arms:
        t = time.perf_counter()
        cap, points = capacity(_scaled(c, replicas, bracket), lambda r, cfg=cfg, router=router:
                               run_point(run_c, cfg, sm, make_wl, r, replicas=replicas,
                                         router=router))
        n = sum(p["summary"]["num_requests"] for p in points)
        wall = time.perf_counter() - t
        print(f"  {model.name:11s} {label:15s} {name:22s} capacity {fmt(cap)} req/s"
              f"  ({len(points)} runs, {n} simulated requests, {wall:.1f} s)", flush=True)
        out.append({"arm": name, "replicas": replicas, "router": router,
                    "engine": dataclasses.asdict(cfg), "capacity_rps": cap, "points": points,
                    "simulated_requests": n, "wall_s": wall})
        progress.set(len(out), arm=name)
    progress.close()
    return out


def _scaled(c, replicas, bracket=None):
    """The rate bracket for ``replicas`` replicas: the per-replica bracket (``bracket``, else
    ``rate_lo .. rate_hi``) times the count; ``replica_bisect_steps`` bisections with a bracket."""
    lo, hi = bracket or (c.rate_lo, c.rate_hi)
    return types.SimpleNamespace(rate_lo=lo * replicas, rate_hi=hi * replicas,
                                 bisect_steps=c.replica_bisect_steps if bracket else c.bisect_steps)


class WithChanges:
    """``c`` with some keys replaced (attribute reads fall through to ``c``)."""

    def __init__(self, c, **changes):
        self._c, self._changes = c, changes

    def __getattr__(self, name):
        return self._changes[name] if name in self._changes else getattr(self._c, name)


def speed(c, cfg, sm, replicas: int) -> list[dict]:
    """Wall time per simulated request at each ``speed_requests`` size (fast-forward on, as in
    every study), and, with ``speed_compare_stepping``, the smallest size stepped one step per
    host pass too: the same records (compared), the wall time it takes."""
    def digest(res):
        return hashlib.sha256(json.dumps([r.as_dict() for r in res.records],
                                         default=str).encode()).hexdigest()[:16]

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
                     "records_sha256": digest(res), "load_average": os.getloadavg()[0],
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
    from experiments import fleet_whatifs

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
        from experiments import fleet_traces

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
        from experiments import fleet_traces

        fleet_traces.plot(traces, (c.trace_ttft_slo_ms, c.trace_tpot_slo_ms), out_dir)
    print(f"wrote {path}")


def fmt(v, spec: str = "8.2f") -> str:
    """``v`` formatted with ``spec``, or ``-`` for ``None`` (a capacity that was not found)."""
    return "-" if v is None else format(v, spec)


if __name__ == "__main__":
    common.run("fleet", main, check)
