"""The fleet study's KV what-ifs: capacity at the SLO per KV format on a modelled H200, simulated.

Three studies of ``experiments/fleet.py`` (``evidence: simulated``; the real scheduler and block
manager per replica, ``RooflineStepModel(H200, model)`` per arm), each a set of arms at the same
KV bytes (``kv_budget``), each arm's capacity found by ``fleet_sweep.capacity`` (bracket, then bisect):

* ``kv_dtype``: one arm per ``kv_dtypes`` entry (``EngineConfig.kv_cache_dtype``): the pool holds
  ``ModelDims.num_blocks`` blocks of that format (values + scales) and the roofline reads and
  writes its bytes (``ModelDims.kv_read_bytes``); ShareGPT-like requests (``kind``) at the engine's
  ``max_model_len``. The Azure traces get the same arms through ``trace_arms`` (variant
  ``kv_dtype`` of the config; ``fleet_traces`` prices each arm with its own format).
* ``window``: ``window_model`` (a model whose every layer slides, e.g. Mistral-7B with
  ``sliding_window`` 4096; or, with ``window_fractions``, the same dimensions with windows of
  those fractions of ``window_max_model_len``) against the same dimensions with full attention,
  at ``window_max_model_len`` with ``window_duration_s`` of offered load: ShareGPT-like lengths
  scaled with ``max_model_len`` (many requests outgrow the window), or with
  ``window_output_len`` > 0 long-output ``fixed`` requests. With the window the replica
  recycles blocks behind it (the real ``paged.kv.blocks.window``) and the roofline reads only
  in-window KV (``paged.sim.batches.step_shape``).
* ``cascade``: one arm per ``cascade_modes`` entry (``EngineConfig.cascade_attention``) on the
  multi-tenant workload (``cascade_num_prefixes`` shared prefixes of ``cascade_prefix_len``
  tokens); the roofline reads a chosen group's shared prefix once (``StepShape.kv_shared``).

KV bytes per replica (``kv_budget``): ``whatif_kv_gb`` GB when > 0, else what one H200 holds
after the weights, ``trace_memory_utilization * trace_hbm_gb - weights`` (the traces' rule).
"""

from __future__ import annotations

import dataclasses

from experiments import fleet_sweep, plots
from paged.config.engine_config import CASCADE_MODES, KV_CACHE_DTYPES
from paged.sim import RooflineStepModel
from paged.sim.specs import MODELS
from paged.workload.workload import make_workload

WHATIFS = ("kv_dtype", "window", "cascade")


def kv_budget(c, model) -> float:
    """KV bytes per replica: ``whatif_kv_gb`` GB, or (0) the HBM of one H200 left after the bf16
    weights (embedding and LM head included) at ``trace_memory_utilization``."""
    if c.whatif_kv_gb > 0:
        return c.whatif_kv_gb * 1e9
    weights = (model.matmul_params + 2 * model.d_model * model.vocab_size) * model.bytes_per_param
    kv = c.trace_memory_utilization * c.trace_hbm_gb * 1e9 - weights
    if kv <= 0:
        raise ValueError(f"{model.name} weights ({weights / 1e9:.1f} GB) fill "
                         f"{c.trace_hbm_gb} GB at utilization {c.trace_memory_utilization}")
    return kv


def check(c, base) -> dict:
    """Validates the what-ifs' keys; returns ``{study: (model name, [(arm, EngineConfig,
    step-model dims)])}`` for each what-if in ``studies`` and each of its models."""
    if c.whatif_kv_gb < 0:
        raise ValueError(f"whatif_kv_gb={c.whatif_kv_gb!r} must be >= 0 (0: from the HBM)")
    plan = {}
    if "kv_dtype" in c.studies:
        bad = [d for d in c.kv_dtypes if d not in KV_CACHE_DTYPES]
        if bad or not c.kv_dtypes:
            raise ValueError(f"kv_dtypes={tuple(c.kv_dtypes)}: unknown {bad}; known: "
                             f"{KV_CACHE_DTYPES}")
        plan["kv_dtype"] = [(name, _arms(c, base, MODELS[name], [
            (f"kv_cache_dtype={d}", {"kv_cache_dtype": d}, None) for d in c.kv_dtypes]))
            for name in c.models]
    if "window" in c.studies:
        model = MODELS.get(c.window_model)
        if model is None or model.sliding_window is None:
            raise ValueError(f"window_model={c.window_model!r} must be a model whose layers "
                             f"slide: {[n for n, m in MODELS.items() if m.sliding_window]}")
        over = {"max_model_len": c.window_max_model_len}
        plan["window"] = [(model.name, _arms(c, base, model, [
            *((f"sliding_window={w}", over, dataclasses.replace(model, sliding_window=w))
              for w in window_sizes(c, model, base.block_size)),
            ("full attention", over, dataclasses.replace(model, sliding_window=None))]))]
    if "cascade" in c.studies:
        bad = [m for m in c.cascade_modes if m not in CASCADE_MODES]
        if bad or not c.cascade_modes:
            raise ValueError(f"cascade_modes={tuple(c.cascade_modes)}: unknown {bad}; known: "
                             f"{CASCADE_MODES}")
        if c.cascade_prefix_len + 2 > base.max_model_len:
            raise ValueError(f"cascade_prefix_len={c.cascade_prefix_len} leaves no room in "
                             f"max_model_len={base.max_model_len}")
        plan["cascade"] = [(name, _arms(c, base, MODELS[name], [
            (f"cascade_attention={m}", {"cascade_attention": m}, None)
            for m in c.cascade_modes])) for name in c.models]
    return plan


def window_sizes(c, model, block_size: int) -> list[int]:
    """The ``window`` study's windows: ``round(f * window_max_model_len)`` per
    ``window_fractions`` entry (each in (0, 1), each window at least ``block_size``), or the
    model's own window when ``window_fractions`` is empty."""
    fracs = tuple(c.window_fractions)
    if not fracs:
        return [model.sliding_window]
    bad = [f for f in fracs if not 0 < f < 1]
    if bad:
        raise ValueError(f"window_fractions={fracs}: each must lie in (0, 1); bad {bad}")
    sizes = [round(f * c.window_max_model_len) for f in fracs]
    if min(sizes) < block_size or len(set(sizes)) != len(sizes):
        raise ValueError(f"window_fractions={fracs} of window_max_model_len="
                         f"{c.window_max_model_len} give windows {sizes}: each must be distinct "
                         f"and >= block_size={block_size}")
    return sizes


def window_workload(c, num: int, rate: float, max_model_len: int):
    """The ``window`` study's requests: ``kind``'s lengths scaled to ``max_model_len``, or (with
    ``window_output_len`` > 0) long-output ``fixed`` requests of ``window_prompt_len`` prompt and
    ``window_output_len`` output tokens."""
    if c.window_output_len <= 0:
        return fleet_sweep.plain_workload(c, num, rate, max_model_len)
    return make_workload("fixed", num, rate, max_model_len=max_model_len, seed=c.seed,
                         prompt_len=c.window_prompt_len, output_len=c.window_output_len)


def _arms(c, base, model, specs) -> list:
    """``(arm, EngineConfig, dims)`` per ``(arm, engine overrides, dims or None = model)``: each
    pool the blocks ``kv_budget`` holds in the arm's KV format."""
    kv = kv_budget(c, model)
    out = []
    for name, overrides, dims in specs:
        cfg = dataclasses.replace(base, **overrides)
        dims = (dims or model).with_kv_cache(cfg)
        out.append((name, dataclasses.replace(cfg, num_blocks=dims.num_blocks(kv, cfg.block_size)),
                    dims))
    return out


def run(c, study: str, plan, dev) -> dict:
    """The capacity of each arm of ``study``; ``{model name: [arm result]}`` (``fleet_sweep.sweep``'s
    rows, each with its pool's ``kv_bytes``)."""
    out = {}
    for name, arms in plan:
        model = MODELS[name]
        if study == "window":
            run_c, make_wl = fleet_sweep.WithChanges(c, duration_s=c.window_duration_s), window_workload
        elif study == "cascade":
            run_c = fleet_sweep.WithChanges(c, num_prefixes=c.cascade_num_prefixes,
                                prefix_len=c.cascade_prefix_len)
            make_wl = fleet_sweep.tenant_workload
        else:
            run_c, make_wl = c, fleet_sweep.plain_workload
        rows = []
        for arm, cfg, dims in arms:
            sm = RooflineStepModel(dev, dims, block_size=cfg.block_size)
            [row] = fleet_sweep.sweep(run_c, study, model, sm, [(arm, cfg, "least_loaded")], make_wl)
            row.update(kv_bytes=kv_budget(c, model), step_model=sm.describe(),
                       at_capacity=_at_capacity(row))
            rows.append(row)
        out[name] = rows
    return out


def _at_capacity(row) -> dict | None:
    """The point at the arm's capacity: its summary (peak blocks, preemptions, throughput)."""
    at = [p for p in row["points"] if p["rate"] == row["capacity_rps"]]
    return at[0]["summary"] if at else None


def plot(results: dict, slo: tuple[float, float], out_dir) -> list:
    """One PNG per what-if in ``results`` (``{model: {study: rows}}``): p99 TTFT and p99 TPOT
    against offered rate, a line per arm, the SLO dashed, each arm's capacity dotted."""
    plt = plots.pyplot()
    paths = []
    for study in WHATIFS:
        runs = [(m, rows) for m, r in results.items() for s, rows in r.items() if s == study]
        if not runs:
            continue
        fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.8 * len(runs)), squeeze=False)
        for (model, rows), (ax_ttft, ax_tpot) in zip(runs, axes):
            for row in rows:
                pts = sorted(row["points"], key=lambda p: p["rate"])
                xs = [p["rate"] for p in pts]
                for ax, key in ((ax_ttft, "p99_ttft_ms"), (ax_tpot, "p99_tpot_ms")):
                    line, = ax.plot(xs, [_nan(p["summary"][key]) for p in pts], marker="o", ms=3,
                                    label=f"{row['arm']} (cap {fleet_sweep.fmt(row['capacity_rps'], '.2f').strip()})")
                    if row["capacity_rps"]:
                        ax.axvline(row["capacity_rps"], color=line.get_color(), ls=":", lw=0.8)
            for ax, key, limit in ((ax_ttft, "p99 TTFT (ms)", slo[0]), (ax_tpot, "p99 TPOT (ms)", slo[1])):
                ax.axhline(limit, color="grey", ls="--", lw=0.8)
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.set_xlabel("offered rate (req/s)")
                ax.set_ylabel(key)
                ax.set_title(f"{model}: {study} (simulated, H200 roofline)", fontsize=9)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        paths.append(plots.save(fig, out_dir / f"whatif_{study}.png"))
    return paths


def _nan(v):
    return float("nan") if v is None else v
