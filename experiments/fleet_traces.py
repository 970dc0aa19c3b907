"""The fleet study's ``traces`` part: capacity on the Azure LLM inference traces 2023, simulated.

Evidence: ``simulated`` (``paged.sim``: the real scheduler and block manager, a roofline device)
over a ``real`` trace (``paged.workload.workload.load_azure_trace``). Per trace and per setup (a model on T
H200s in tensor parallel, ``TensorParallelRooflineStepModel``; T = 1 is the plain
``RooflineStepModel``) and per arm (engine overrides: paged + continuous batching + prefix
caching, without prefix caching, contiguous KV + static batching, block sizes, KV cache dtypes:
each arm's step model reads and writes the arm's own KV format), the highest offered
rate at which every request finishes (by ``max_time_factor * span + 30`` simulated seconds) with
p99 TTFT and p99 TPOT within the SLO.

The workload of a trace: the trace, then (each recorded in its label) a window and a subsample if
configured, lengths clipped to ``trace_max_model_len``, synthetic prompt ids from
``trace_prompt_seed`` (the shared system prompt only if ``trace_system_prompt_len > 0``, an
assumption), and, per point, ``time_scale natural_rate / rate``: the real arrival process with every
gap shrunk by one factor, so its burstiness stays. The search brackets the rate between
``trace_speedup_lo`` and ``trace_speedup_hi`` times the trace's own mean rate (widening as
``fleet_sweep.capacity`` does) and bisects ``trace_bisect_steps`` times (geometric midpoints).

KV memory per replica: ``trace_memory_utilization * T * trace_hbm_gb`` minus the model's bf16
weights (embedding and LM head included); no activation reserve. Every point keeps its failed
requests (aborted at the time limit, timed out, rejected) as records and their counts.
"""

from __future__ import annotations

import dataclasses
import time
import types

from experiments import fleet_sweep, plots
from paged.fleet.routing import Router
from paged.sim import Simulator
from paged.sim.roofline import TensorParallelRooflineStepModel
from paged.sim.specs import MODELS
from paged.workload.workload import AZURE_TRACES, Workload, check_same_evidence

_FAILED_KEYS = ("request_id", "status", "arrival_s", "first_token_s", "finish_s", "prompt_len",
                "output_len", "num_preemptions")


def check(c, base) -> dict:
    """Validates the ``trace_*`` keys; returns each trace's base workload and each setup's
    engine configs (one per arm) and step model."""
    bad = [s for s in c.trace_services if s not in AZURE_TRACES]
    if bad or not c.trace_services:
        raise ValueError(f"trace_services={tuple(c.trace_services)}: unknown {bad}; known: "
                         f"{tuple(AZURE_TRACES)}")
    from experiments import common

    common.check_positive(trace_ttft_slo_ms=c.trace_ttft_slo_ms,
                          trace_tpot_slo_ms=c.trace_tpot_slo_ms, trace_speedup_lo=c.trace_speedup_lo,
                          trace_speedup_hi=c.trace_speedup_hi, trace_hbm_gb=c.trace_hbm_gb,
                          trace_memory_utilization=c.trace_memory_utilization,
                          trace_subsample=c.trace_subsample)
    if c.trace_speedup_hi <= c.trace_speedup_lo:
        raise ValueError(f"trace_speedup_hi={c.trace_speedup_hi} must exceed "
                         f"trace_speedup_lo={c.trace_speedup_lo}")
    if c.trace_memory_utilization > 1 or c.trace_subsample > 1:
        raise ValueError(f"trace_memory_utilization={c.trace_memory_utilization}, trace_subsample="
                         f"{c.trace_subsample}: each must be in (0, 1]")
    if isinstance(c.trace_bisect_steps, bool) or not isinstance(c.trace_bisect_steps, int) \
            or c.trace_bisect_steps < 0:
        raise ValueError(f"trace_bisect_steps={c.trace_bisect_steps!r} must be an int >= 0")
    window = tuple(c.trace_window)
    if window and len(window) != 2:
        raise ValueError(f"trace_window={window!r} must be () or (start_s, end_s)")
    setups = []
    for i, item in enumerate(c.trace_setups):
        try:
            model, tp = item
        except (TypeError, ValueError):
            raise ValueError(f"trace_setups[{i}]={item!r} must be a (model, tensor_parallel) "
                             "pair") from None
        if model not in MODELS:
            raise ValueError(f"trace_setups[{i}]: model {model!r}; known: {sorted(MODELS)}")
        dims = MODELS[model]
        sm = TensorParallelRooflineStepModel(fleet_sweep.device(c), dims.with_kv_cache(base),
                                             tensor_parallel=tp)  # the base's KV storage
        kv = c.trace_memory_utilization * tp * c.trace_hbm_gb * 1e9 - _weight_bytes(dims)
        if kv <= 0:
            raise ValueError(f"trace_setups[{i}]: {model} weights ({_weight_bytes(dims) / 1e9:.1f}"
                             f" GB) fill {tp} x {c.trace_hbm_gb} GB at utilization "
                             f"{c.trace_memory_utilization}")
        arms = []
        for j, arm in enumerate(c.trace_arms):
            name, overrides = common.named_pair(arm, f"trace_arms[{j}]", "engine field")
            cfg = dataclasses.replace(base, max_model_len=c.trace_max_model_len, **overrides)
            blocks = dims.with_kv_cache(cfg).num_blocks(kv, cfg.block_size)
            cfg = dataclasses.replace(cfg, num_blocks=blocks)
            arms.append((name, cfg))
        if not arms:
            raise ValueError("trace_arms=() names no arm")
        setups.append({"name": f"{model} x{tp} H200" + (" (tensor parallel)" if tp > 1 else ""),
                       "model": model, "tensor_parallel": tp, "kv_bytes": kv, "step_model": sm,
                       "arms": arms})
    if not setups:
        raise ValueError("trace_setups=() names no setup")
    traces = {s: fleet_sweep.trace_to_scale(
        s, window=window, subsample=c.trace_subsample, seed=c.seed,
        max_model_len=c.trace_max_model_len, prompt_seed=c.trace_prompt_seed,
        system_prompt_len=c.trace_system_prompt_len, window_key="trace_window")
        for s in c.trace_services}
    return {"traces": traces, "setups": setups}


def _weight_bytes(m) -> float:
    """bf16 weights held in memory: decoder blocks, embedding and LM head (untied)."""
    return (m.matmul_params + 2 * m.d_model * m.vocab_size) * m.bytes_per_param


def natural_rate(w: Workload) -> float:
    return len(w) / w.duration_s


def run_point(c, cfg, sm, base: Workload, rate: float) -> dict:
    """One simulated run of ``base`` time-scaled to a mean of ``rate`` req/s."""
    factor = natural_rate(base) / rate
    w = base.time_scaled(factor)
    sim = Simulator(cfg, sm, num_replicas=1, router=Router("least_loaded"), model_config=sm.model,
                    build_device=False)
    res = sim.run(w, max_time_s=c.max_time_factor * w.duration_s + 30.0,
                  ttft_slo_ms=c.trace_ttft_slo_ms, tpot_slo_ms=c.trace_tpot_slo_ms)
    s = res.summary
    keep = ("completed", "num_requests", "num_aborted", "num_timeout", "num_rejected",
            "request_throughput", "output_throughput", "request_goodput", "num_good",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_e2el_ms",
            "engine_preemptions", "prefix_cache_hit_tokens", "prefix_cache_hit_rate",
            "peak_used_blocks", "kv_num_blocks", "num_engine_steps", "duration")
    failed = [{k: v for k, v in r.as_dict().items() if k in _FAILED_KEYS}
              for r in res.records if r.status != "finished"]
    slo = types.SimpleNamespace(ttft_slo_ms=c.trace_ttft_slo_ms, tpot_slo_ms=c.trace_tpot_slo_ms)
    return {"rate": rate, "time_scale": factor, "meets_slo": fleet_sweep.meets(s, slo),
            "evidence": s["evidence"], "workload_evidence": w.evidence,
            "derived": w.meta["derived"], "label": w.label(),
            "summary": {k: s.get(k) for k in keep}, "failed": failed,
            "wall_s": res.wall_s, "cpu_s": res.cpu_s, "sim_s": res.sim_s}


def run(c, plan) -> dict:
    """Every trace x setup x arm: the capacity search; returns the JSON-ready results."""
    out = {}
    for service, base in plan["traces"].items():
        nat = natural_rate(base)
        print(f"  trace {service}: {len(base)} requests, {base.duration_s:.0f} s, mean "
              f"{nat:.3f} req/s; {base.label()}", flush=True)
        rows = []
        for setup in plan["setups"]:
            sm = setup["step_model"]
            for name, cfg in setup["arms"]:
                t0 = time.perf_counter()
                bracket = types.SimpleNamespace(rate_lo=nat * c.trace_speedup_lo,
                                                rate_hi=nat * c.trace_speedup_hi,
                                                bisect_steps=c.trace_bisect_steps)
                # The arm's own KV storage and block size (a quantized arm reads fewer bytes).
                bsm = dataclasses.replace(sm, model=sm.model.with_kv_cache(cfg),
                                          block_size=cfg.block_size)
                memo = {}  # the bracket search may ask for a rate twice

                def point(r, cfg=cfg, bsm=bsm, memo=memo, base=base):
                    if r not in memo:
                        memo[r] = run_point(c, cfg, bsm, base, r)
                    return memo[r]

                cap, _ = fleet_sweep.capacity(bracket, point)
                points = sorted(memo.values(), key=lambda p: p["rate"])
                check_same_evidence([{"evidence": p["workload_evidence"], "derived": p["derived"],
                                      "name": f"{name}@{p['rate']:.3g}"} for p in points],
                                    swept=("time_scale",))
                wall = time.perf_counter() - t0
                at = next((p for p in points if p["rate"] == cap), None)
                print(f"  {service:4s} {setup['name']:32s} {name:26s} capacity {fleet_sweep.fmt(cap)} "
                      f"req/s (time_scale {fleet_sweep.fmt(nat / cap if cap else None, '.4f')}); "
                      f"{len(points)} runs, {wall:.1f} s", flush=True)
                rows.append({"setup": setup["name"], "model": setup["model"],
                             "tensor_parallel": setup["tensor_parallel"], "arm": name,
                             "engine": dataclasses.asdict(cfg), "step_model": bsm.describe(),
                             "kv_bytes": setup["kv_bytes"], "capacity_rps": cap,
                             "capacity_time_scale": nat / cap if cap else None,
                             "at_capacity": at and at["summary"], "points": points,
                             "wall_s": wall})
        out[service] = {"label": base.label(), "meta": base.meta, "natural_rate_rps": nat,
                        "summary": {k: v for k, v in base.summary().items()},
                        "arms": rows}
    for service in out:  # one comparison per trace (the arms and setups of one trace)
        check_same_evidence([{"evidence": p["workload_evidence"], "derived": p["derived"]}
                             for a in out[service]["arms"] for p in a["points"]],
                            swept=("time_scale",))
    return out


def plot(out: dict, slo: tuple[float, float], out_dir) -> list:
    """One PNG per trace: goodput (requests/s meeting the SLO) against offered rate, log axes, a
    panel per setup, a line per arm (arms with equal results draw over each other; the legend
    lists every arm's capacity), capacity marked."""
    plt = plots.pyplot()
    paths = []
    for service, t in out.items():
        setups = list(dict.fromkeys(a["setup"] for a in t["arms"]))
        fig, axes = plt.subplots(1, len(setups), figsize=(6.2 * len(setups), 4.2), squeeze=False)
        for ax, setup in zip(axes[0], setups):
            for a in (a for a in t["arms"] if a["setup"] == setup):
                xs = [p["rate"] for p in a["points"]]
                ys = [p["summary"]["request_goodput"] or None for p in a["points"]]
                line, = ax.plot(xs, ys, marker="o", ms=3, label=f"{a['arm']} "
                                f"(cap {fleet_sweep.fmt(a['capacity_rps'], '.2f').strip()})")
                if a["capacity_rps"]:
                    ax.axvline(a["capacity_rps"], color=line.get_color(), ls=":", lw=0.8)
            rates = [p["rate"] for a in t["arms"] if a["setup"] == setup for p in a["points"]]
            ax.plot([min(rates), max(rates)], [min(rates), max(rates)], color="grey", lw=0.6,
                    ls="--", label="goodput = offered")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("offered rate (req/s, the trace time-scaled)")
            ax.set_ylabel(f"goodput (req/s, TTFT <= {slo[0]:g} ms, TPOT <= {slo[1]:g} ms)")
            ax.set_title(setup, fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"Azure {service} trace: evidence simulated over real; {t['label']}",
                     fontsize=8)
        paths.append(plots.save(fig, out_dir / f"goodput_{service}.png"))
    return paths
