"""How much host memory should a Llama-3-8B H200 replica have for its KV tier? (simulated)

Evidence: ``simulated`` (``paged.sim``: the real scheduler, block manager and host-tier
bookkeeping of ``EngineConfig(host_kv_cache_bytes=N)``; a roofline H200, ``paged.sim.H200``; the
tier's copies priced on a host-device link, ``paged.sim.host_link``: a load before the step's
compute, an offload beside it). One replica; its device KV pool is what one H200 holds after the
bf16 weights (``device_kv_gb`` overrides). Arms: the host tier off and at ``host_multipliers``
times the device pool's bytes, on each link of ``links`` (PCIe Gen5 x16, NVLink-C2C).

Workloads (never mixed in one comparison):

* ``conversations`` (constructed): ``num_tenants`` system prompts; conversations of ``turns``
  turns, each turn's prompt the tenant's system prompt plus the history (every earlier turn's
  ``user_len`` user tokens and ``reply_len`` reply tokens) plus the new user tokens. The replies
  in the history are constructed ids, not the simulated outputs (the simulator's tokens are
  pseudo-tokens), so only prompt blocks are reused, never decode blocks. Turns are sent round by
  round (every conversation's turn 1 in a random order, then every turn 2, ...), Poisson
  arrivals at the point's rate, so between two turns of one conversation every other
  conversation passes through the pool. The number of conversations makes the distinct prefix
  tokens ``prefix_over_pool`` times the device pool's tokens.
* ``azure`` (simulated over derived-real): a window of the Azure LLM inference trace 2023
  (conversation service), lengths clipped, synthetic prompt ids with one shared system prompt of
  ``azure.system_prompt_len`` tokens: an ASSUMPTION (the trace has token counts only, no text and
  no conversation ids, so it carries no multi-turn reuse to exploit). Run at one rate per arm.

Per arm: the capacity at the SLO (``fleet.capacity``: the highest rate whose run finishes every
request with p99 TTFT and p99 TPOT within the SLO, bracketed then bisected; the same requests at
every rate, arrivals scaled), then one run at the reference rate (the tier-off arm's capacity) so
that every arm's TTFT p50 / p99, hit rates per tier and copy seconds compare at the same load.

Writes ``host_tier_fleet.json`` and ``host_tier_fleet.png`` under the output directory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import numpy as np

from experiments import common, fleet, fleet_whatifs, plots
from paged.fleet.routing import Router
from paged.sim import EVIDENCE, RooflineStepModel, Simulator, check_not_mixed
from paged.sim.host_link import HOST_LINKS, TierPricer
from paged.sim.specs import MODELS
from paged.workload.workload import (
    BOS_ID,
    RequestSpec,
    Workload,
    load_azure_trace,
    synthetic_prompt,
)

STUDY = "host_tier_fleet"
_KEEP = ("completed", "num_requests", "request_throughput", "output_throughput",
         "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "engine_preemptions",
         "prefix_cache_hit_tokens", "peak_used_blocks", "kv_num_blocks", "num_engine_steps",
         "host_tier_hit_tokens", "host_tier_loaded_blocks", "host_tier_offloaded_blocks",
         "host_tier_load_s", "host_tier_offload_s", "host_tier_load_wait_s",
         "host_tier_copy_only_steps", "host_tier_offload_bound_steps", "host_tier_num_loads")


# --- workloads --------------------------------------------------------------------------------
def conversations(c, pool_tokens: int) -> Workload:
    """The constructed multi-tenant multi-turn workload (module docstring), arrivals at 1 req/s
    (each point time-scales them)."""
    w = c.workload
    rng = np.random.default_rng(w.seed)
    per_conv = w.turns * w.user_len + (w.turns - 1) * w.reply_len
    num_convs = max(1, math.ceil(w.prefix_over_pool * pool_tokens / per_conv))
    system = [(BOS_ID,) + synthetic_prompt(w.system_prompt_len - 1, rng=rng)
              for _ in range(w.num_tenants)]
    tenant = rng.integers(0, w.num_tenants, num_convs)
    chunks = [[synthetic_prompt(w.user_len, rng=rng) + (synthetic_prompt(w.reply_len, rng=rng)
                                                        if k < w.turns - 1 else ())
               for k in range(w.turns)] for _ in range(num_convs)]
    order = [(i, k) for k in range(w.turns) for i in rng.permutation(num_convs).tolist()]
    gaps = rng.exponential(1.0, len(order))
    arrivals = np.cumsum(gaps) - gaps[0]
    reqs = []
    for n, ((i, k), t) in enumerate(zip(order, arrivals.tolist())):
        history = sum(chunks[i][:k], ())
        prompt = system[tenant[i]] + history + chunks[i][k][:w.user_len]
        reqs.append(RequestSpec(f"c{i}t{k}-{n}", t, prompt, None, len(prompt), w.output_len))
    distinct = w.num_tenants * w.system_prompt_len + num_convs * per_conv
    return Workload("conversations", tuple(reqs), "constructed", w.seed, {
        "num_conversations": num_convs, "turns": w.turns, "tenants": w.num_tenants,
        "distinct_prefix_tokens": distinct, "device_pool_tokens": pool_tokens,
        "distinct_over_pool": distinct / pool_tokens, "order": "round by round, Poisson"})


def azure(c) -> Workload:
    """The Azure conversation trace's window with an ASSUMED shared system prompt."""
    a = c.azure
    w = load_azure_trace("conv").window(*a.window).clip_lengths(a.max_model_len)
    return w.with_synthetic_prompts(a.prompt_seed, system_prompt_len=a.system_prompt_len)


# --- plan -------------------------------------------------------------------------------------
def check(c) -> dict:
    if c.model not in MODELS:
        raise ValueError(f"model={c.model!r}; known: {sorted(MODELS)}")
    bad = [k for k in c.links if k not in HOST_LINKS]
    if bad or not c.links:
        raise ValueError(f"links={tuple(c.links)}: unknown {bad}; known: {tuple(HOST_LINKS)}")
    mults = tuple(c.host_multipliers)
    if not mults or any(isinstance(m, bool) or not isinstance(m, (int, float)) or m < 0
                        for m in mults) or len(set(mults)) != len(mults):
        raise ValueError(f"host_multipliers={mults!r} must be distinct numbers >= 0")
    common.check_positive(ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms,
                          rate_lo=c.rate_lo, rate_hi=c.rate_hi, max_time_factor=c.max_time_factor,
                          hbm_gb=c.hbm_gb, memory_utilization=c.memory_utilization)
    if c.rate_hi <= c.rate_lo:
        raise ValueError(f"rate_hi={c.rate_hi} must exceed rate_lo={c.rate_lo}")
    if c.device_kv_gb < 0:
        raise ValueError(f"device_kv_gb={c.device_kv_gb!r} must be >= 0 (0: from the HBM)")
    w = c.workload
    common.check_positive(**{f"workload.{k}": w[k] for k in (
        "num_tenants", "system_prompt_len", "turns", "user_len", "reply_len", "output_len",
        "prefix_over_pool")})
    base = common.make_engine_config(c.engine, model="sim")
    longest = w.system_prompt_len + w.turns * w.user_len + (w.turns - 1) * w.reply_len
    if longest + w.output_len > base.max_model_len:
        raise ValueError(f"the last turn needs {longest + w.output_len} tokens > "
                         f"engine.max_model_len={base.max_model_len}")
    model = MODELS[c.model].with_kv_cache(base)
    kv = fleet_whatifs.kv_budget(fleet.WithChanges(
        c, whatif_kv_gb=c.device_kv_gb, trace_hbm_gb=c.hbm_gb,
        trace_memory_utilization=c.memory_utilization), model)
    cfg = dataclasses.replace(base, num_blocks=model.num_blocks(kv, base.block_size))
    pool_bytes = (cfg.num_blocks - 1) * model.kv_bytes_per_block(cfg.block_size)
    arms = []  # (name, link key or None, multiplier, EngineConfig)
    for m in mults:
        for link in (c.links if m else (None,)):
            tier = int(m * pool_bytes)
            arm = dataclasses.replace(cfg, host_kv_cache_bytes=tier)
            if tier:
                TierPricer(HOST_LINKS[link], model.kv_bytes_per_block(cfg.block_size))
            arms.append((f"host {m:g}x" + (f" {link}" if link else " (off)"), link, m, arm))
    plan = {"model": model, "kv_bytes": kv, "pool_bytes": pool_bytes, "config": cfg,
            "arms": arms, "workload": conversations(c, (cfg.num_blocks - 1) * cfg.block_size)}
    if c.azure.enabled:
        common.check_positive(**{"azure.speedup": c.azure.speedup})
        plan["azure"] = azure(c)
    return plan


# --- runs -------------------------------------------------------------------------------------
def run_point(c, cfg, sm, link, base: Workload, rate: float) -> dict:
    """One simulated run of ``base`` time-scaled to ``rate`` req/s."""
    w = base.time_scaled(len(base) / base.duration_s / rate)
    sim = Simulator(cfg, sm, router=Router("least_loaded"), model_config=sm.model,
                    build_device=False, host_link=HOST_LINKS[link] if link else None)
    res = sim.run(w, max_time_s=c.max_time_factor * w.duration_s + 30.0,
                  ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms)
    s = res.summary
    prompt = sum(r.prompt_len for r in w.requests)
    host = s.get("host_tier_hit_tokens", 0)
    return {"rate": rate, "meets_slo": fleet.meets(s, c), "evidence": s["evidence"],
            "workload_evidence": w.evidence, "summary": {k: s.get(k) for k in _KEEP},
            "prompt_tokens": prompt, "device_hit_rate": (s["prefix_cache_hit_tokens"] - host) / prompt,
            "host_hit_rate": host / prompt, "prefill_tokens": res.replicas[0]["num_prefill_tokens"],
            "wall_s": res.wall_s, "cpu_s": res.cpu_s, "sim_s": res.sim_s}


def main(c, plan):
    out_dir = common.output_dir(c, STUDY)
    dev, model = fleet.device(c), plan["model"]
    sm = RooflineStepModel(dev, model, block_size=plan["config"].block_size)
    wl = plan["workload"]
    print(f"{model.name} on one H200: device pool {plan['config'].num_blocks - 1} blocks "
          f"({plan['pool_bytes'] / 1e9:.1f} GB); {len(wl)} requests of "
          f"{wl.meta['num_conversations']} conversations, distinct prefix tokens "
          f"{wl.meta['distinct_over_pool']:.1f}x the pool", flush=True)
    rows, ref = [], None
    progress = common.Progress(len(plan["arms"]), STUDY, unit="arm", summary=False)
    for name, link, mult, cfg in plan["arms"]:
        t = time.perf_counter()
        cap, points = fleet.capacity(c, lambda r, cfg=cfg, link=link: run_point(
            c, cfg, sm, link, wl, r))
        if ref is None:  # the tier-off arm (first): every arm is also run at its capacity
            ref = cap or c.rate_lo
        at_ref = next((p for p in points if p["rate"] == ref), None) or run_point(
            c, cfg, sm, link, wl, ref)
        row = {"arm": name, "link": link, "host_multiplier": mult,
               "host_kv_cache_bytes": cfg.host_kv_cache_bytes, "capacity_rps": cap,
               "reference_rate": ref, "at_reference": at_ref, "points": points,
               "wall_s": time.perf_counter() - t}
        if cfg.host_kv_cache_bytes:
            row["link_figures"] = dataclasses.asdict(HOST_LINKS[link])
        rows.append(row)
        s = at_ref["summary"]
        print(f"  {name:16s} capacity {fleet.fmt(cap)} req/s | at {ref:.2f} req/s: TTFT p50 "
              f"{fleet.fmt(s['median_ttft_ms'], '.0f')} p99 {fleet.fmt(s['p99_ttft_ms'], '.0f')} ms,"
              f" hits device {at_ref['device_hit_rate']:.0%} host {at_ref['host_hit_rate']:.0%}"
              f"  ({len(points)} runs, {row['wall_s']:.0f} s)", flush=True)
        progress.set(len(rows), arm=name)
    progress.close()
    trace = None
    if "azure" in plan:
        trace = run_azure(c, plan, sm)
    labels = [{"evidence": p["evidence"]} for r in rows for p in r["points"]]
    if trace:
        labels += [{"evidence": r["point"]["evidence"]} for r in trace["arms"]]
    path = common.write_result(out_dir / f"{STUDY}.json", {
        "study": STUDY, "evidence": check_not_mixed(labels) if labels else EVIDENCE,
        "model": dataclasses.asdict(model), "device": dataclasses.asdict(dev),
        "device_kv_bytes": plan["kv_bytes"], "device_pool_bytes": plan["pool_bytes"],
        "device_pool_blocks": plan["config"].num_blocks - 1,
        "slo": {"p99_ttft_ms": c.ttft_slo_ms, "p99_tpot_ms": c.tpot_slo_ms},
        "links": {k: dataclasses.asdict(HOST_LINKS[k]) for k in c.links},
        "workload": {"name": wl.name, "evidence": wl.evidence, **wl.meta},
        "conversations": rows, "azure": trace, "config": c.to_dict(),
        "provenance": {**common.provenance(), "load_average": list(os.getloadavg())}})
    if c.plots:
        plot(rows, c, out_dir / f"{STUDY}.png")
    print(f"wrote {path}")


def run_azure(c, plan, sm) -> dict:
    """Every arm once on the Azure window at ``azure.speedup`` times its own rate."""
    w = plan["azure"]
    rate = c.azure.speedup * len(w) / w.duration_s
    cfg_len = {"max_model_len": c.azure.max_model_len}
    out = []
    for name, link, mult, cfg in plan["arms"]:
        cfg = dataclasses.replace(cfg, **cfg_len)
        p = run_point(c, cfg, sm, link, w, rate)
        out.append({"arm": name, "link": link, "host_multiplier": mult, "point": p})
        print(f"  azure conv {name:16s} at {rate:.1f} req/s: TTFT p99 "
              f"{fleet.fmt(p['summary']['p99_ttft_ms'], '.0f')} ms, hits device "
              f"{p['device_hit_rate']:.1%} host {p['host_hit_rate']:.1%}", flush=True)
    return {"label": w.label(), "workload_evidence": w.evidence, "rate": rate,
            "system_prompt_len": c.azure.system_prompt_len,
            "assumption": "every request starts with one shared system prompt (the trace has "
                          "token counts only)", "arms": out}


def plot(rows: list, c, path) -> None:
    """Capacity, host hit rate and p99 TTFT at the reference rate against the host multiplier,
    one line per link (the tier-off arm at 0 on every line)."""
    plt = plots.pyplot()
    off = [r for r in rows if not r["host_multiplier"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for link in c.links:
        rs = off + [r for r in rows if r["link"] == link]
        xs = [r["host_multiplier"] for r in rs]
        axes[0].plot(xs, [r["capacity_rps"] or float("nan") for r in rs], marker="o", label=link)
        axes[1].plot(xs, [r["at_reference"]["host_hit_rate"] for r in rs], marker="o", label=link)
        axes[2].plot(xs, [r["at_reference"]["summary"]["p99_ttft_ms"] or float("nan")
                          for r in rs], marker="o", label=link)
    ref = rows[0]["reference_rate"]
    for ax, title in zip(axes, ("capacity at the SLO (req/s)", f"host hit rate at {ref:.1f} req/s",
                                f"p99 TTFT at {ref:.1f} req/s (ms)")):
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("host tier / device pool bytes")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].axhline(c.ttft_slo_ms, color="grey", ls="--", lw=0.8)
    fig.suptitle(f"{c.model} on one H200 with a host KV tier (simulated)", fontsize=10)
    plots.save(fig, path)


if __name__ == "__main__":
    common.run(STUDY, main, check)
