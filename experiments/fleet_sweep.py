"""The fleet studies' shared helpers: the modelled device, an engine at a KV budget, the
workloads, one simulated point, the capacity search (bracket, then bisect) and a sweep of arms.

``experiments/fleet.py`` (the study entry), ``fleet_traces.py`` and ``fleet_whatifs.py`` use them
(``disaggregation.py`` its Azure trace preparation); this module imports none of those.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
import types

import numpy as np

from experiments import common
from paged.fleet.routing import Router
from paged.sim import H200, Simulator
from paged.sim.specs import H200_DATASHEET_BW
from paged.workload.workload import (
    BOS_ID,
    Workload,
    load_azure_trace,
    make_workload,
    synthetic_prompt,
)


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


def trace_to_scale(service: str, *, window: tuple, subsample: float, seed: int,
                   max_model_len: int, prompt_seed: int, system_prompt_len: int = 0,
                   window_key: str = "window") -> Workload:
    """The Azure trace ``service`` (``evidence: real``) made ready to be time-scaled to a rate:
    the arrivals in ``window`` (``()`` = all), a ``subsample`` share of them (seeded by ``seed``)
    when below 1, lengths clipped to ``max_model_len``, synthetic prompt ids from
    ``prompt_seed`` (a shared system prompt of ``system_prompt_len`` tokens if > 0).

    Raises:
      ValueError: naming the trace: a step refused its argument, or fewer than 2 requests (or
        no duration) are left, too few to scale (the message names ``window_key`` to widen).
    """
    w = load_azure_trace(service)
    try:
        if window:
            w = w.window(*window)
        if subsample < 1:
            w = w.subsample(subsample, seed)
        w = w.clip_lengths(max_model_len)
        w = w.with_synthetic_prompts(prompt_seed, system_prompt_len=system_prompt_len)
    except (ValueError, TypeError) as e:
        raise ValueError(f"trace {service!r}: {e}") from None
    if len(w) < 2 or w.duration_s <= 0:
        raise ValueError(f"trace {service!r}: {len(w)} requests over {w.duration_s} s: too few to "
                         f"scale (widen {window_key})")
    return w


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


def fmt(v, spec: str = "8.2f") -> str:
    """``v`` formatted with ``spec``, or ``-`` for ``None`` (a capacity that was not found)."""
    return "-" if v is None else format(v, spec)



def records_sha256(res) -> str:
    """The first 16 hex digits of the sha256 of a run's records (``tests/test_sim_pinned.py``)."""
    return hashlib.sha256(json.dumps([r.as_dict() for r in res.records],
                                     default=str).encode()).hexdigest()[:16]
