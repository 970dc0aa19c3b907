"""The host KV tier on a multi-tenant, multi-turn workload: TTFT, throughput and hits per tier.

Arms: the same engine and device pool with the host tier off and with ``host_kv_cache_bytes`` at
``multiplier *`` the device pool's bytes (``config.host_multipliers``). Every arm serves the same
constructed workload online, requests added at their Poisson arrival times:

* ``num_tenants`` tenants, each with its own system prompt and its own cache salt (tenants never
  share blocks); ``conversations_per_tenant`` conversations each; ``turns`` turns per
  conversation, turn ``k``'s prompt being the system prompt plus ``k`` user chunks of
  ``turn_len`` tokens (the history grows; the model's replies are not fed back, which keeps the
  prompts identical across arms). Turns are sent round by round (every conversation's turn 1 in
  a random order, then every turn 2, ...), so between two turns of a conversation the others'
  prompts pass through the device pool. The distinct prefix blocks of the workload are several
  times the pool (``workload.distinct_prefix_blocks`` in the JSON).

Measured per arm: TTFT p50 / p99 (first token - arrival), output throughput (output tokens / wall
seconds from the first arrival to the last finish; compilation excluded with ``config.warmup``),
prompt tokens served by each tier (``RequestOutput.num_cached_tokens`` minus
``num_host_cached_tokens``: device; ``num_host_cached_tokens``: host) over all prompt tokens, and
the tier's counters (``kv_stats()["host_tier"]``: blocks offloaded and loaded, load wait).

Not measured here: a GPU (the host-device copy on CPU is a memcpy, so the time a load saves over a
recompute is not the accelerator's), and the simulator's pricing of loads and offloads by
host-device bandwidth.

Writes ``kv_tiers.json`` and ``kv_tiers.png`` (TTFT p50 / p99 and hit rates against the arm).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np

from experiments import common, plots
from paged import Engine, SamplingParams
from paged.workload.workload import RequestSpec, Workload


# --- workload ---------------------------------------------------------------------------------
def build_workload(c) -> tuple[Workload, list[str]]:
    """The constructed workload and each request's tenant salt (by request order)."""
    w = c.workload
    common.check_positive(**{f"workload.{k}": w[k] for k in (
        "num_tenants", "conversations_per_tenant", "turns", "system_prompt_len", "turn_len",
        "output_len", "rate")})
    rng = np.random.default_rng(w.seed)
    longest = w.system_prompt_len + w.turns * w.turn_len + w.output_len
    if longest > c.engine.max_model_len:
        raise ValueError(f"the last turn needs {longest} tokens > engine.max_model_len="
                         f"{c.engine.max_model_len}: lower workload.turns or turn_len")
    system = [[256] + rng.integers(0, 256, w.system_prompt_len - 1).tolist()
              for _ in range(w.num_tenants)]
    convs = [(t, rng.integers(0, 256, w.turns * w.turn_len).tolist())
             for t in range(w.num_tenants) for _ in range(w.conversations_per_tenant)]
    order = []
    for k in range(1, w.turns + 1):
        order += [(i, k) for i in rng.permutation(len(convs)).tolist()]
    gaps = rng.exponential(1.0 / w.rate, len(order))
    arrivals = np.cumsum(gaps) - gaps[0]
    requests, salts = [], []
    for n, ((i, k), t) in enumerate(zip(order, arrivals)):
        tenant, user = convs[i]
        prompt = tuple(system[tenant] + user[:k * w.turn_len])
        requests.append(RequestSpec(f"t{tenant}c{i}k{k}-{n}", float(t), prompt, None,
                                    len(prompt), w.output_len))
        salts.append(f"tenant-{tenant}")
    B = c.engine.block_size
    distinct = w.num_tenants * (w.system_prompt_len // B) + len(convs) * (
        (w.system_prompt_len + w.turns * w.turn_len) // B - w.system_prompt_len // B)
    wl = Workload("multi-tenant-multi-turn", tuple(requests), "constructed", w.seed,
                  {"distinct_prefix_blocks": distinct, "tenants": w.num_tenants,
                   "conversations": len(convs), "turns": w.turns})
    return wl, salts


def check(c) -> dict:
    """Checks every setting; builds the workload and one EngineConfig per arm (no model yet)."""
    common.check_model(c.model)
    common.check_unset(c.engine, ("host_kv_cache_bytes",), "host_multipliers")
    mults = tuple(c.host_multipliers)
    if not mults or len(set(mults)) != len(mults) or any(
            isinstance(m, bool) or not isinstance(m, (int, float)) or m < 0 for m in mults):
        raise ValueError(f"host_multipliers={mults!r} must be distinct numbers >= 0")
    ecfg = common.make_engine_config(c.engine)
    if ecfg.num_blocks is None:
        raise ValueError("engine.num_blocks must be set: the study sizes the tier from the pool")
    wl, salts = build_workload(c)
    return {"engine_config": ecfg, "multipliers": mults, "workload": wl, "salts": salts}


# --- measurement ------------------------------------------------------------------------------
def run_arm(engine: Engine, wl: Workload, salts: list[str], bar) -> dict:
    """Serves ``wl`` online on the idle ``engine``; per-request records and the arm's summary."""
    reqs = list(wl.requests)
    records: dict[str, dict] = {}
    nxt, done, out_tokens = 0, 0, 0
    t0 = time.perf_counter()
    while nxt < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(reqs) and reqs[nxt].arrival_s <= now:
            r = reqs[nxt]
            engine.add_request(r.request_id, r.engine_prompt(), SamplingParams(
                max_tokens=r.output_len, temperature=0.0, ignore_eos=True),
                arrival_time=t0 + r.arrival_s, cache_salt=salts[nxt])
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, reqs[nxt].arrival_s - (time.perf_counter() - t0)))
            continue
        for out in engine.step():
            if out.finished:
                records[out.request_id] = {
                    "ttft_s": out.first_token_time - out.arrival_time,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "cached_tokens": out.num_cached_tokens,
                    "host_cached_tokens": out.num_host_cached_tokens,
                    "output_tokens": len(out.token_ids)}
                out_tokens += len(out.token_ids)
                done += 1
                bar.set(done)
    wall = time.perf_counter() - t0
    ttft = np.array([r["ttft_s"] for r in records.values()])
    prompt = sum(r["prompt_tokens"] for r in records.values())
    host = sum(r["host_cached_tokens"] for r in records.values())
    device = sum(r["cached_tokens"] for r in records.values()) - host
    stats = engine.kv_stats()
    return {
        "completed": len(records), "wall_s": wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "ttft_mean_s": float(ttft.mean()),
        "throughput_tok_s": out_tokens / wall,
        "prompt_tokens": prompt,
        "device_hit_rate": device / prompt, "host_hit_rate": host / prompt,
        "device_hit_tokens": device, "host_hit_tokens": host,
        "preemptions": stats["num_preemptions"],
        "host_tier": stats["host_tier"],
        "records": records,
    }


def run(c, out_dir: Path, plan: dict | None = None) -> dict:
    plan = plan or check(c)
    ecfg, wl, salts = plan["engine_config"], plan["workload"], plan["salts"]
    model, params = common.load_model(c.model)
    rows = []
    pool_bytes = None
    for m in plan["multipliers"]:
        if pool_bytes is None:  # the device pool's bytes, from an engine without a tier
            probe = Engine(ecfg, model_config=model, params=params)
            pool_bytes = probe.kv_stats()["ledger"]["pool_bytes"]
            del probe
        cfg = dataclasses.replace(ecfg, host_kv_cache_bytes=int(m * pool_bytes))
        engine = Engine(cfg, model_config=model, params=params)
        compiled = engine.warmup(logprobs=False, parallel_sampling=False) if c.warmup else 0
        name = "tier off" if m == 0 else f"host {m:g}x pool"
        bar = common.Progress(len(wl.requests), f"[kv_tiers {name}]")
        res = run_arm(engine, wl, salts, bar)
        bar.close()
        rows.append({"arm": name, "host_multiplier": m,
                     "host_kv_cache_bytes": cfg.host_kv_cache_bytes,
                     "warmup_compilations": compiled, **res})
        print(f"{name}: TTFT p50 {res['ttft_p50_s'] * 1e3:.1f} ms p99 "
              f"{res['ttft_p99_s'] * 1e3:.1f} ms, {res['throughput_tok_s']:.1f} tok/s, hits "
              f"device {res['device_hit_rate']:.1%} host {res['host_hit_rate']:.1%}", flush=True)
    print(format_table(rows))
    payload = {
        "study": "kv_tiers", "evidence": wl.evidence, "config": c.to_dict(),
        "engine_config": dataclasses.asdict(ecfg), "device_pool_bytes": pool_bytes,
        "model": {"name": c.model, "config": model.to_dict()},
        "workload": {"name": wl.name, "meta": wl.meta, "summary": wl.summary()},
        "definitions": {
            "ttft": "first token time - arrival time, per request (online, Poisson arrivals)",
            "throughput_tok_s": "output tokens / wall seconds from the first arrival to the "
                                "last finish (compilation excluded when config.warmup)",
            "device_hit_rate": "prompt tokens served by the device prefix cache / prompt tokens",
            "host_hit_rate": "prompt tokens loaded from the host tier / prompt tokens"},
        "not_measured": "a GPU (on CPU a host-device copy is a memcpy); simulator pricing of "
                        "loads and offloads by host-device bandwidth",
        "arms": rows, "load_avg": os.getloadavg(), "provenance": common.provenance()}
    path = common.write_result(out_dir / "kv_tiers.json", payload)
    if c.plots:
        plot(rows, out_dir / "kv_tiers.png")
    print(f"wrote {path}")
    return payload


# --- report -----------------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    lines = [f"{'arm':16s}{'TTFT p50':>10s}{'TTFT p99':>10s}{'tok/s':>8s}{'dev hit':>8s}"
             f"{'host hit':>9s}{'offload':>8s}{'load':>6s}"]
    for r in rows:
        t = r["host_tier"]
        lines.append(f"{r['arm']:16s}{r['ttft_p50_s'] * 1e3:>8.1f}ms{r['ttft_p99_s'] * 1e3:>8.1f}ms"
                     f"{r['throughput_tok_s']:>8.1f}{r['device_hit_rate']:>8.1%}"
                     f"{r['host_hit_rate']:>9.1%}{t['offloaded_blocks']:>8d}"
                     f"{t['loaded_blocks']:>6d}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    """TTFT p50 / p99 and hit rate per tier, per arm."""
    plt = plots.pyplot()

    names = [r["arm"] for r in rows]
    x = np.arange(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(x - 0.2, [r["ttft_p50_s"] * 1e3 for r in rows], 0.4, label="p50")
    a.bar(x + 0.2, [r["ttft_p99_s"] * 1e3 for r in rows], 0.4, label="p99")
    a.set_ylabel("TTFT (ms)")
    b.bar(x, [r["device_hit_rate"] for r in rows], 0.6, label="device tier")
    b.bar(x, [r["host_hit_rate"] for r in rows], 0.6, bottom=[r["device_hit_rate"] for r in rows],
          label="host tier")
    b.set_ylabel("prompt tokens served from cache")
    for ax in (a, b):
        ax.set_xticks(x, names)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    plots.save(fig, path)
    return path


def main(c, plan):
    run(c, common.output_dir(c, "kv_tiers"), plan)


if __name__ == "__main__":
    common.run("kv_tiers", main, check)
