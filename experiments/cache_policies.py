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
* ``prefill_tokens_saved``: prompt tokens served from the cache; TTFT p50 / p99 (simulated).

Writes ``cache_policies.json``, ``cache_policies.md`` (the table) and ``cache_policies.png``.
"""

from __future__ import annotations

import dataclasses
import os
import time

from experiments import common, plots
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
    common.check_positive(max_time_factor=c.max_time_factor)
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
        for frac in c.pool_fractions:
            num_blocks = max(int(frac * distinct), plan["base"].max_blocks_per_seq) + 1
            for policy in c.policies:
                cfg = dataclasses.replace(plan["base"], num_blocks=num_blocks,
                                          prefix_eviction=policy)
                r = {"trace": name, "pool_fraction": frac, "pool_blocks": num_blocks - 1,
                     **run_arm(c, cfg, plan["model"], w)}
                rows.append(r)
                print(f"  pool {frac:g} ({num_blocks - 1} blocks) {policy:10s} hit "
                      f"{r['hit_rate']:.1%} belady {r['belady_block']:.1%} "
                      f"({_pct(r['frac_of_belady'])} of it) ttft p50/p99 "
                      f"{_ms(r['ttft_p50_ms'])}/{_ms(r['ttft_p99_ms'])} ms "
                      f"[{r['wall_s']:.0f} s]", flush=True)
    table = markdown(rows)
    (out_dir / f"{STUDY}.md").write_text(table + "\n")
    print(table)
    path = common.write_result(out_dir / f"{STUDY}.json", {
        "study": STUDY, "evidence": check_not_mixed([{"evidence": r["evidence"]} for r in rows])
        if rows else EVIDENCE, "model": dataclasses.asdict(plan["model"]),
        "device": dataclasses.asdict(H200), "traces": traces, "rows": rows,
        "config": c.to_dict(),
        "provenance": {**common.provenance(), "load_average": list(os.getloadavg())}})
    if c.plots:
        plot(rows, out_dir / f"{STUDY}.png")
    print(f"wrote {path}")


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def markdown(rows) -> str:
    head = ("| trace | pool (blocks) | policy | hit rate | Belady (block / prefix) | "
            "of Belady | prefill tokens saved | TTFT p50 / p99 ms | completed |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['trace']} | {r['pool_fraction']:g} ({r['pool_blocks']}) | {r['policy']} | "
            f"{r['hit_rate']:.1%} | {r['belady_block']:.1%} / {r['belady_prefix']:.1%} | "
            f"{_pct(r['frac_of_belady'])} | {r['prefill_tokens_saved'] / r['prompt_tokens']:.1%}"
            f" | {_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])} | "
            f"{r['completed']}/{r['num_requests']} |")
    return "\n".join(lines)


def plot(rows, path) -> None:
    plt = plots.pyplot()
    groups = sorted({(r["trace"], r["pool_fraction"]) for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(groups), 4))
    width = 0.8 / len(policies)
    for i, p in enumerate(policies):
        xs, ys = [], []
        for g, (trace, frac) in enumerate(groups):
            r = next((r for r in rows if (r["trace"], r["pool_fraction"], r["policy"])
                      == (trace, frac, p)), None)
            if r is not None and r["frac_of_belady"] is not None:
                xs.append(g + i * width)
                ys.append(100 * r["frac_of_belady"])
        ax.bar(xs, ys, width, label=p)
    ax.axhline(90, color="k", lw=0.8, ls="--")
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                  [f"{t}\npool {f:g}x distinct" for t, f in groups])
    ax.set_ylabel("device hit rate, % of Belady (MIN)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Prefix-cache eviction vs the offline optimum (simulated H200, Mooncake traces)",
                 fontsize=9)
    plots.save(fig, path)


if __name__ == "__main__":
    common.run(STUDY, main, check)
