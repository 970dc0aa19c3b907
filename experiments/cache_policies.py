"""Prefix-cache eviction policies against Belady's optimum on the Mooncake traces (simulated).

Evidence: ``simulated`` over ``real`` workloads (the Mooncake FAST'25 traces,
``paged.workload.mooncake_trace``: token ids built from the trace's block ids, a recorded
derivation). One simulated H200 (``paged.sim.RooflineStepModel``, Llama-3-8B dimensions) runs the
real scheduler and block manager; each arm sets ``EngineConfig.prefix_eviction``. The block
manager records every admission's prompt block keys (``BlockManager.record_accesses``);
``paged.kv.blocks.belady`` replays that sequence with the same number of blocks for the offline
optimum. Per (trace, pool size, policy):

* ``hit_rate``: prompt blocks served by the device cache / prompt blocks looked up (the final
  token's block is never looked up);
* ``belady_block`` / ``belady_prefix``: MIN's hit rate on the same accesses (``block``: the bound;
  ``prefix``: MIN's hits before each request's first miss), and ``frac_of_belady`` =
  ``hit_rate / belady_block``;
* ``prefill_tokens_saved``: prompt tokens served from the cache (device and host tier);
  ``host_hit_tokens``: those the host tier served; TTFT p50 / p99 (simulated).

Factors beside the policy: ``schedulers`` (``EngineConfig.policy``: ``decode-first`` is FCFS
admission, ``lpm`` / ``dfs-weight`` the cache-aware orders), ``host_fractions`` (a host tier of
``fraction`` x the device pool's blocks, 0: none) and ``rate_scales`` (the trace's arrivals
compressed to ``scale`` x its own rate, 1: as recorded): with more than one scale the arm's
capacity at the SLO is the highest scale at which it and every lower one finished every request
with p99 TTFT <= ``ttft_slo_ms`` (`experiments.capacity.capacity`), reported as a multiple of
the trace's rate and in requests per second.

Writes ``cache_policies.json``, ``cache_policies.md`` (the table) and ``cache_policies.png``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time

from experiments import common, plots
from experiments.capacity import capacity
from paged.config.eviction import parse_eviction
from paged.fleet.routing import Router
from paged.kv.blocks.belady import belady
from paged.sim import EVIDENCE, RooflineStepModel, Simulator, check_not_mixed
from paged.sim.specs import H200, MODELS
from paged.workload import mooncake_trace

STUDY = "cache_policies"


def check(c) -> dict:
    if c.model not in MODELS:
        raise ValueError(f"model={c.model!r}; known: {sorted(MODELS)}")
    for p in c.policies:
        parse_eviction(p)
    if not c.policies or len(set(c.policies)) != len(c.policies):
        raise ValueError(f"policies={tuple(c.policies)!r} must be distinct and not empty")
    bad = [t for t in c.traces if t not in mooncake_trace.TRACES]
    if bad or not c.traces:
        raise ValueError(f"traces={tuple(c.traces)!r}: unknown {bad}; known: "
                         f"{tuple(mooncake_trace.TRACES)}")
    if not c.pool_fractions or any(not 0 < f <= 4 for f in c.pool_fractions):
        raise ValueError(f"pool_fractions={tuple(c.pool_fractions)!r} must be in (0, 4]")
    common.check_positive(max_time_factor=c.max_time_factor, ttft_slo_ms=c.ttft_slo_ms)
    if not c.schedulers or not c.host_fractions or not c.rate_scales:
        raise ValueError("schedulers, host_fractions and rate_scales must not be empty")
    if any(not 0 <= f <= 64 for f in c.host_fractions):
        raise ValueError(f"host_fractions={tuple(c.host_fractions)!r} must be in [0, 64]")
    if any(not 0 < r <= 64 for r in c.rate_scales):
        raise ValueError(f"rate_scales={tuple(c.rate_scales)!r} must be in (0, 64]")
    for sched in c.schedulers:
        common.make_engine_config({**c.engine.to_dict(), "policy": sched}, model="sim")
    base = common.make_engine_config(c.engine, model="sim")
    if base.block_size != mooncake_trace.BLOCK_TOKENS:
        raise ValueError(f"engine.block_size={base.block_size} must be "
                         f"{mooncake_trace.BLOCK_TOKENS} (an engine block is a trace block)")
    return {"base": base, "model": MODELS[c.model].with_kv_cache(base)}


def load(c, name: str):
    """The trace's window as a workload, and its distinct prompt blocks."""
    window = tuple(c.windows[name])
    w = mooncake_trace.load_mooncake_trace(name, window=window or None)
    rows = mooncake_trace.read(name)
    ids = {h for r in w.requests for h in rows.hash_ids[int(r.request_id.rsplit("-", 1)[1])]}
    return w, len(ids)


def run_arm(c, cfg, model, w) -> dict:
    """One simulated run of ``w`` under ``cfg``: its hit rates, MIN's on the same accesses, TTFT."""
    sm = RooflineStepModel(H200, model, block_size=cfg.block_size)
    sim = Simulator(cfg, sm, router=Router("least_loaded"), model_config=sm.model,
                    build_device=False)
    log: list = []
    sim.replicas[0].block_manager.record_accesses(lambda d, h: log.append((d, h)))
    t = time.perf_counter()
    res = sim.run(w, max_time_s=c.max_time_factor * w.duration_s + 60.0)
    wall = time.perf_counter() - t
    s = res.summary
    looked = sum(len(d) for d, _ in log)
    hits = sum(h for _, h in log)
    opt = belady([d for d, _ in log], cfg.num_blocks - 1)
    prompt = sum(r.prompt_len for r in w.requests)
    return {"policy": cfg.prefix_eviction, "evidence": s["evidence"], "admissions": len(log),
            "blocks_looked_up": looked, "block_hits": hits,
            "hit_rate": hits / looked if looked else 0.0,
            "belady_block": opt["block_hit_rate"], "belady_prefix": opt["prefix_hit_rate"],
            "frac_of_belady": (hits / looked) / opt["block_hit_rate"] if opt["block_hits"] else None,
            "prefill_tokens_saved": s.get("prefix_cache_hit_tokens", 0), "prompt_tokens": prompt,
            "host_hit_tokens": s.get("host_tier_hit_tokens", 0),
            "host_blocks": cfg.host_kv_cache_bytes // model.kv_bytes_per_block(cfg.block_size),
            "completed": s.get("completed"), "num_requests": len(w),
            "ttft_p50_ms": s.get("median_ttft_ms"), "ttft_p99_ms": s.get("p99_ttft_ms"),
            "preemptions": s.get("engine_preemptions"), "sim_s": res.sim_s, "wall_s": wall}


def main(c, plan):
    out_dir = common.output_dir(c, STUDY)
    rows, traces = [], {}
    for name in c.traces:
        w, distinct = load(c, name)
        traces[name] = {"label": w.label(), "evidence": w.evidence, "requests": len(w),
                        "distinct_prompt_blocks": distinct, "span_s": w.duration_s,
                        "meta": {k: v for k, v in w.meta.items() if k != "derived"},
                        "derived": w.meta["derived"]}
        print(f"{name}: {len(w)} requests, {distinct} distinct prompt blocks ({w.label()})",
              flush=True)
        for frac, sched, host, policy, scale in itertools.product(
                c.pool_fractions, c.schedulers, c.host_fractions, c.policies, c.rate_scales):
            num_blocks = max(int(frac * distinct), plan["base"].max_blocks_per_seq) + 1
            kv_block = plan["model"].kv_bytes_per_block(plan["base"].block_size)
            cfg = dataclasses.replace(plan["base"], num_blocks=num_blocks, prefix_eviction=policy,
                                      policy=sched,
                                      host_kv_cache_bytes=int(host * (num_blocks - 1)) * kv_block)
            ws = w if scale == 1 else w.time_scaled(1.0 / scale)
            r = {"trace": name, "pool_fraction": frac, "pool_blocks": num_blocks - 1,
                 "scheduler": sched, "host_fraction": host, "rate_scale": scale,
                 "rate_rps": len(ws) / ws.duration_s, **run_arm(c, cfg, plan["model"], ws)}
            r["meets_slo"] = (r["completed"] == r["num_requests"] and r["ttft_p99_ms"] is not None
                              and r["ttft_p99_ms"] <= c.ttft_slo_ms)
            rows.append(r)
            print(f"  pool {frac:g} ({num_blocks - 1}) {sched} host {host:g} x{scale:g} "
                  f"{policy:10s} hit {r['hit_rate']:.1%} belady {r['belady_block']:.1%} "
                  f"({_pct(r['frac_of_belady'])} of it) ttft p50/p99 "
                  f"{_ms(r['ttft_p50_ms'])}/{_ms(r['ttft_p99_ms'])} ms "
                  f"[{r['wall_s']:.0f} s]", flush=True)
    caps = capacities(rows, traces) if len(c.rate_scales) > 1 else []
    table = markdown(rows) + ("\n\n" + capacity_table(caps, c.ttft_slo_ms) if caps else "")
    (out_dir / f"{STUDY}.md").write_text(table + "\n")
    print(table)
    path = common.write_result(out_dir / f"{STUDY}.json", {
        "study": STUDY, "evidence": check_not_mixed([{"evidence": r["evidence"]} for r in rows])
        if rows else EVIDENCE, "model": dataclasses.asdict(plan["model"]),
        "device": dataclasses.asdict(H200), "traces": traces, "rows": rows, "capacities": caps,
        "config": c.to_dict(),
        "provenance": {**common.provenance(), "load_average": list(os.getloadavg())}})
    if c.plots:
        plot(rows, out_dir / f"{STUDY}.png")
    print(f"wrote {path}")


def arm_key(r) -> tuple:
    return (r["trace"], r["pool_fraction"], r["scheduler"], r["host_fraction"], r["policy"])


def capacities(rows, traces) -> list[dict]:
    """Per arm (all but the rate): the highest rate scale within the SLO (and every lower one)."""
    out = []
    for key in dict.fromkeys(arm_key(r) for r in rows):
        pts = [{"rate": r["rate_scale"], "meets_slo": r["meets_slo"]}
               for r in rows if arm_key(r) == key]
        cap = capacity(pts)
        tr = traces[key[0]]
        out.append({**dict(zip(("trace", "pool_fraction", "scheduler", "host_fraction",
                                 "policy"), key)),
                    "capacity_scale": cap, "rates_tried": sorted(p["rate"] for p in pts),
                    "capacity_rps": None if cap is None else cap * tr["requests"] / tr["span_s"]})
    return out


def capacity_table(caps, slo_ms) -> str:
    lines = [f"| trace | pool | scheduler | host | policy | capacity at p99 TTFT <= {slo_ms:g} ms "
             "(x trace rate, req/s) | scales tried |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for k in caps:
        cap = "below all" if k["capacity_scale"] is None else (
            f"{k['capacity_scale']:g} ({k['capacity_rps']:.2f})")
        lines.append(f"| {k['trace']} | {k['pool_fraction']:g} | {k['scheduler']} | "
                     f"{k['host_fraction']:g} | {k['policy']} | {cap} | "
                     f"{', '.join(f'{x:g}' for x in k['rates_tried'])} |")
    return "\n".join(lines)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def markdown(rows) -> str:
    head = ("| trace | pool (blocks) | scheduler | host | rate | policy | hit rate | "
            "Belady (block / prefix) | of Belady | prefill tokens saved (host) | "
            "TTFT p50 / p99 ms | completed |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['trace']} | {r['pool_fraction']:g} ({r['pool_blocks']}) | {r['scheduler']} | "
            f"{r['host_fraction']:g} | x{r['rate_scale']:g} | {r['policy']} | "
            f"{r['hit_rate']:.1%} | {r['belady_block']:.1%} / {r['belady_prefix']:.1%} | "
            f"{_pct(r['frac_of_belady'])} | {r['prefill_tokens_saved'] / r['prompt_tokens']:.1%}"
            f" ({r['host_hit_tokens'] / r['prompt_tokens']:.1%})"
            f" | {_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])} | "
            f"{r['completed']}/{r['num_requests']} |")
    return "\n".join(lines)


def plot(rows, path) -> None:
    """Each policy's hit rate as a % of MIN's, a bar group per (trace, pool, scheduler, host
    tier) at the first rate scale of each."""
    plt = plots.pyplot()
    first = {}
    for r in rows:
        first.setdefault(arm_key(r)[:4], r["rate_scale"])
    rows = [r for r in rows if r["rate_scale"] == first[arm_key(r)[:4]]]
    groups = list(dict.fromkeys(arm_key(r)[:4] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.8 + 1.1 * len(groups), 4.5))
    width = 0.8 / len(policies)
    for i, p in enumerate(policies):
        xs, ys = [], []
        for g, key in enumerate(groups):
            r = next((r for r in rows if arm_key(r) == (*key, p)), None)
            if r is not None and r["frac_of_belady"] is not None:
                xs.append(g + i * width)
                ys.append(100 * r["frac_of_belady"])
        ax.bar(xs, ys, width, label=p)
    ax.axhline(90, color="k", lw=0.8, ls="--")
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                  [f"{t[:5]} pool {f:g}\n{sc[:5]} host {h:g}" for t, f, sc, h in groups],
                  fontsize=7, rotation=30)
    ax.set_ylabel("device hit rate, % of Belady (MIN)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Prefix-cache eviction vs the offline optimum (simulated H200, Mooncake traces)",
                 fontsize=9)
    plots.save(fig, path)


if __name__ == "__main__":
    common.run(STUDY, main, check)
