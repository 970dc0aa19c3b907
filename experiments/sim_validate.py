"""Validation: the same constructed workloads through the real engine and through the simulator.

The real side is ``experiments/serving.py``'s real-time driver (``run_arm``) on a fresh engine per
point (engines with one model share their compiled step). The simulated side is
``paged.sim.Simulator`` with the same ``EngineConfig`` and the linear step-time model fitted on
this machine by ``experiments/calibrate.py`` (and, with ``model_idle_wake``, the driver's
admission lateness when the engine is idle, measured in the run each model was fitted on:
``Simulator(idle_wake_s=...)``). Side by side per point: p50 / p99 TTFT and TPOT,
request and output throughput, preemptions and peak KV blocks, each with the simulator's relative
error ``(sim - real) / real``; per workload, the saturation rate of each. The real results are
``constructed`` (a real engine on a constructed workload), the simulated ones ``simulated``; they
sit in separate fields and are compared, never pooled. Each real run's replay record goes to
``replay.json`` (arm ``<workload>@<rate>``, ``... repeat`` for ``repeat_real``):
``python -m experiments.replay --from=<dir>`` re-executes it exactly.

Two simulated variants: ``sim`` (the fitted model) and ``sim_noisy`` (the fitted model times
a ratio drawn from the calibration's measured / predicted spread, ``paged.sim.NoisyStepModel``;
only with a serving-mode calibration, which stores that spread).

With ``paired_calibration`` (the default), two more: ``sim_paired`` / ``sim_paired_noisy``,
fitted (plain least squares, calibrate's serving features) on a calibration run made right before
the point's real run: the same workload kind, shared prefix, rate and engine, other requests
(seed ``seed + 1000 + point index``; at least ``paired_min_requests`` of them, so a low rate's run
is longer than the point's), so it measures the step periods in the same stretch of
machine load and the same engine regime (how busy the engine keeps the cores), never the point's
own steps. On a shared CPU the machine's load drifts within minutes and a step of the same
shape takes 2-3x longer when it is high, so one calibration for the whole grid (``sim``) carries
that drift into every point; the paired one is the per-point calibration a user would make before
asking a what-if of this machine.

With ``repeat_real`` (the default), ``real_repeat``: the real engine serves the same requests a
second time, right after the first run, and is scored against the first exactly as the simulated
variants are (evidence ``constructed``, not simulated). Its errors are the noise floor of this
machine: a simulator cannot be shown closer to the real engine than the real engine is to
itself, and on a shared CPU the p99 of a few hundred requests moves by tens of per cent between
two runs of the same requests.

Per point, the real run's p50 and p99 of TTFT and TPOT also get a 95 % percentile-bootstrap
interval over its requests (``real_ci``), and every variant says whether its figure lies inside
(``<variant>_in_real_ci``; counted below saturation in the verdict): the sampling uncertainty
of the real measurement itself, apart from the machine's run-to-run drift that ``real_repeat``
shows.

Diagnostic ``sim_self`` (with ``self_fit``): fitted on the point's own real steps (in sample, not
a validation): the error left when the step-time model is as good as a shape-only fit can be,
i.e. the simulator's own (scheduling, queueing, timing) error.

With ``alt_features`` (a tuple of ``paged.sim.linear_model.FEATURES`` names), ``sim_paired_alt`` and
``sim_self_alt``: the same fits as ``sim_paired`` and ``sim_self`` (the same rows) with that form,
so two forms are compared on the same real runs.

With ``leave_one_out``, two more: ``sim_loo`` / ``sim_loo_noisy``, fitted (plain least squares,
calibrate's serving features) on the real steps of every *other* point of this run, recorded
while they ran: the same stretch of machine load, never the point's own steps. On a machine other
work shares, step times drift with that work; these variants separate that drift from the
simulator's own error.

Goal (``goal_p50`` / ``goal_p99``): within 10 % on p50 and 20 % on p99 below saturation, and the
same saturation rate within one grid step. The output says which points met it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ml_collections
import numpy as np

from experiments import common, serving
from experiments.replay import replay_command
from paged.sim import (
    NoisyStepModel,
    Simulator,
    check_not_mixed,
    fit_linear,
    load_model_json,
)
from paged.sim.linear_model import FEATURES
from paged.sim.measured import ratio_quantiles
from paged.workload.workload import make_workload

METRICS = (("p50_ttft_ms", "median_ttft_ms", "p50"), ("p99_ttft_ms", "p99_ttft_ms", "p99"),
           ("p50_tpot_ms", "median_tpot_ms", "p50"), ("p99_tpot_ms", "p99_tpot_ms", "p99"),
           ("request_throughput", "request_throughput", "rate"),
           ("output_throughput", "output_throughput", "rate"),
           ("preemptions", "engine_preemptions", "count"),
           ("peak_used_blocks", "peak_used_blocks", "count"))


def check(c) -> dict:
    common.check_model(c.model)
    engine_config = common.make_engine_config(c.engine, model=c.model)
    if engine_config.async_scheduling:
        raise ValueError("engine.async_scheduling=True: the simulator models serial steps; "
                         "set it to False")
    common.check_positive(duration_s=c.duration_s, max_drain_s=c.max_drain_s,
                          saturated_ttft_ms=c.saturated_ttft_ms, goal_p50=c.goal_p50,
                          goal_p99=c.goal_p99)
    if isinstance(c.paired_min_requests, bool) or not isinstance(c.paired_min_requests, int) \
            or c.paired_min_requests < 0:
        raise ValueError(f"paired_min_requests={c.paired_min_requests!r} must be an int >= 0")
    unknown = sorted(set(c.alt_features) - set(FEATURES))
    if unknown:
        raise ValueError(f"alt_features={tuple(c.alt_features)}: unknown {unknown}; known: "
                         f"{sorted(FEATURES)}")
    if c.calibration and not os.path.isfile(c.calibration):
        raise ValueError(f"calibration={c.calibration!r}: no such file (run experiments.calibrate, "
                         "or set calibration='' to calibrate now)")
    if not c.calibration and c.calibrate_grid not in ("smoke", "default", "serving"):
        raise ValueError(f"calibrate_grid={c.calibrate_grid!r} must be 'smoke', 'default' or "
                         "'serving' (a calibrate.py variant)")
    points = []
    for i, entry in enumerate(c.workloads):
        try:
            name, kind, prefix, rates = entry
        except (TypeError, ValueError):
            raise ValueError(f"workloads[{i}]={entry!r} must be (name, kind, shared_prefix_len, "
                             "rates)") from None
        if not rates:
            raise ValueError(f"workloads[{i}] ({name}) has no rates")
        for rate in rates:
            common.check_positive(**{f"workloads[{i}].rate": rate})
            w = make_workload(kind, max(2, round(rate * c.duration_s)), float(rate),
                              max_model_len=engine_config.max_model_len, seed=c.seed,
                              shared_prefix_len=int(prefix))
            points.append({"workload": str(name), "rate": float(rate), "wl": w, "kind": kind,
                           "prefix": int(prefix)})
    if not points:
        raise ValueError("workloads=() names no workload")
    return {"engine": engine_config, "points": points}


def step_model(c, engine_config, model, out_dir):
    """The calibrated model: from ``c.calibration``, or fitted now on this machine."""
    if c.calibration:
        data = json.loads(Path(c.calibration).read_text())
        _check_calibration(data, engine_config, c.model)
        return load_model_json(data), {"source": c.calibration, "fit": data["model"].get("fit"),
                                       "sleep_overshoot_s": data.get("sleep_overshoot_s", 0.0),
                                       "idle_admit_late_s": data.get("idle_admit_late_s")}
    from experiments import calibrate
    from experiments.configs import calibrate as cal_config

    g = cal_config.get_config(c.calibrate_grid)
    g.engine = ml_collections.ConfigDict(c.engine.to_dict())
    g.engine.enable_prefix_caching = False
    g.model = c.model
    g.context_lens = tuple(x for x in g.context_lens if x + g.steps + 4 < engine_config.max_model_len)
    g.decode_batch_sizes = tuple(b for b in g.decode_batch_sizes if b <= engine_config.max_num_seqs)
    plan = calibrate.check(g)
    g.serving_duration_s = min(g.serving_duration_s, c.duration_s)
    cal_engine = plan["engine"]
    if g.mode == "serving":  # serving periods: the validation's own engine settings
        cal_engine = engine_config
    sm, payload = calibrate.calibrate(g, cal_engine, model)
    common.write_result(out_dir / "calibration.json", calibrate.thin(dict(payload), g.keep_points))
    return sm, {"source": f"calibrated now ({c.calibrate_grid} variant): "
                          f"{out_dir / 'calibration.json'}",
                "fit": {k: v for k, v in sm.fit.items() if k != "residuals_s"},
                "sleep_overshoot_s": payload["sleep_overshoot_s"],
                "idle_admit_late_s": payload.get("idle_admit_late_s")}


def _check_calibration(data, engine_config, model_name) -> None:
    cal = data.get("engine_config", {})
    for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "min_token_bucket",
                "min_seq_bucket", "attention_impl", "dtype"):
        if key in cal and cal[key] != getattr(engine_config, key):
            print(f"note: calibration measured {key}={cal[key]!r}, this run uses "
                  f"{getattr(engine_config, key)!r}")
    if data.get("model_name") not in (None, model_name):
        print(f"note: calibration measured model {data.get('model_name')!r}, this run {model_name!r}")


# metric -> (per-request value, percentile) for the bootstrap intervals of the real run
CI_METRICS = {"p50_ttft_ms": ("ttft", 50), "p99_ttft_ms": ("ttft", 99),
              "p50_tpot_ms": ("tpot", 50), "p99_tpot_ms": ("tpot", 99)}


def bootstrap_ci(records, seed: int, *, n: int = 1000, level: float = 0.95) -> dict:
    """Percentile-bootstrap interval of each ``CI_METRICS`` figure of a real run: the requests
    resampled with replacement ``n`` times (the figures as ``metrics.summarize`` computes them:
    finished requests; TPOT of those with more than one output token). ``None`` below 2 values.
    It says how far the run's own p50 / p99 could have moved with other requests of the same
    kind, which a simulator's figure is then compared with."""
    done = [r for r in records if r.status == "finished"]
    vals = {"ttft": np.array([r.ttft_s * 1e3 for r in done]),
            "tpot": np.array([r.tpot_s * 1e3 for r in done if r.tpot_s is not None])}
    rng = np.random.default_rng(seed)
    out = {}
    for name, (kind, q) in CI_METRICS.items():
        x = vals[kind]
        if len(x) < 2:
            out[name] = None
            continue
        stats = np.percentile(x[rng.integers(0, len(x), (n, len(x)))], q, axis=1)
        out[name] = [float(np.quantile(stats, (1 - level) / 2)),
                     float(np.quantile(stats, 1 - (1 - level) / 2))]
    return out


def in_ci(values: dict, ci: dict) -> dict:
    """Per ``CI_METRICS`` figure: whether ``values[name]`` lies in the real run's interval."""
    return {name: bool(ci.get(name) is not None and values.get(name) is not None
                       and ci[name][0] <= values[name] <= ci[name][1]) for name in CI_METRICS}


def rel(sim, real):
    if sim is None or real is None:
        return None
    if real == 0:
        return 0.0 if sim == 0 else None
    return (sim - real) / real


def saturated(summary, c) -> bool:
    ttft = summary.get("p99_ttft_ms")
    return summary["completed"] < summary["num_requests"] or ttft is None or \
        ttft > c.saturated_ttft_ms


def run_real(c, engine_config, model, point, replays=None,
             suffix: str = "") -> tuple[dict, list, list]:
    """The real run of one point (on a new engine); also records each step's shape and period
    (``experiments.calibrate.ServingRecorder``) for the leave-one-out fits. ``replays`` gets its
    replay record (arm ``<workload>@<rate><suffix>``)."""
    from experiments.calibrate import ServingRecorder

    w = point["wl"]
    engine = serving.build_engine(engine_config, model)
    rec = ServingRecorder(engine)
    t0 = time.perf_counter()
    try:
        real = serving.run_arm(f"{point['workload']}@{point['rate']:g}{suffix}", engine, w,
                               max_wall_s=w.duration_s + c.max_drain_s, progress=False,
                               model_name=c.model)
    finally:
        rec.close()
    if replays is not None:
        replays.append(real.replay)
    rs = real.summary
    row = {"workload": point["workload"], "rate": point["rate"], "num_requests": len(w),
           "load_average": os.getloadavg()[0], "real_wall_s": time.perf_counter() - t0,
           "real_saturated": saturated(rs, c), "real": {name: rs.get(key) for name, key, _ in METRICS},
           "real_evidence": rs["evidence"], "real_steps": len(rec.rows)}
    row["idle_admit_late_s"] = _median(rec.admit_late)
    row["real_ci"] = bootstrap_ci(real.records, c.seed)
    return row, rec.rows, rec.admit_late


def _median(xs):
    return float(np.median(xs)) if len(xs) else None


def add_repeat(row: dict, again: dict) -> None:
    """The real engine run again on the same requests, as the ``real_repeat`` variant: its
    relative difference from the first run is the noise floor of every error in the row."""
    row["real_repeat"] = again["real"]
    row["real_repeat_rel_error"] = {name: rel(again["real"][name], row["real"][name])
                                    for name, _, _ in METRICS}
    row["real_repeat_saturated"] = again["real_saturated"]
    row["real_repeat_in_real_ci"] = in_ci(again["real"], row["real_ci"])
    row["real_repeat_evidence"] = again["real_evidence"]
    row["real_repeat_load_average"] = again["load_average"]
    row["real_repeat_wall_s"] = again["real_wall_s"]


def paired_models(c, engine_config, model, point, index: int) -> tuple[dict, dict]:
    """A calibration run just before the point's real run: same kind, prefix, rate and engine,
    other requests (seed ``seed + 1000 + index``); the models fitted on its step periods."""
    from experiments.calibrate import ServingRecorder

    # At least ``paired_min_requests``: a low rate's run is otherwise too short to separate the
    # prefill-chunk and after-pause terms (its few prefill steps mostly follow a pause).
    num = max(len(point["wl"]), c.paired_min_requests)
    w = make_workload(point["kind"], num, point["rate"], max_model_len=engine_config.max_model_len,
                      seed=c.seed + 1000 + index, shared_prefix_len=point["prefix"])
    engine = serving.build_engine(engine_config, model)
    rec = ServingRecorder(engine)
    try:
        serving.run_arm(f"calibrate {point['workload']}@{point['rate']:g}", engine, w,
                        max_wall_s=w.duration_s + c.max_drain_s, progress=False)
    finally:
        rec.close()
    info = {"seed": c.seed + 1000 + index, "num_steps": len(rec.rows),
            "load_average": os.getloadavg()[0], "idle_admit_late_s": _median(rec.admit_late)}
    m = _fit_rows(rec.rows)
    if m is None:
        return {}, info
    shapes, times = [r[0] for r in rec.rows], [r[1] for r in rec.rows]
    q = ratio_quantiles(times, [m.time(sh) for sh in shapes])
    info.update(coef=m.coef, rms_rel_error=m.fit["rms_rel_error"])
    out = {"sim_paired": lambda: m, "sim_paired_noisy": lambda: NoisyStepModel(m, q, seed=c.seed)}
    alt = _fit_alt(c, rec.rows)
    if alt is not None:
        out["sim_paired_alt"] = lambda: alt
        info["alt_coef"] = alt.coef
    return out, info


def _fit_alt(c, rows):
    """``_fit_rows`` in the ``alt_features`` form, or ``None`` when none is set."""
    return _fit_rows(rows, c.alt_features) if c.alt_features else None


OPTIONAL = ("after_idle", "prefill_seqs")  # dropped, in this order, when the rows lack them


def _fit_rows(rows, feats=None):
    """``fit_linear`` (absolute) of recorded (shape, period) rows in ``feats`` (default:
    calibrate's serving form); without ``after_idle`` if no step followed a pause, then without
    ``prefill_seqs`` if that does not vary either; ``None`` if the rows cannot determine a fit."""
    if feats is None:
        from experiments.configs import calibrate as cal_config

        feats = cal_config.get_config("serving").serving_features
    shapes, times = [r[0] for r in rows], [r[1] for r in rows]
    f = tuple(feats)
    for drop in (None, *OPTIONAL):
        if drop is not None:
            f = tuple(x for x in f if x != drop)
        try:
            return fit_linear(shapes, times, f, weights="absolute")
        except ValueError:
            continue
    return None


def run_sims(c, engine_config, model, models, point, row, wakes: dict) -> None:
    """Each simulated variant of ``models`` (name -> model factory) on the point's requests, an
    idle replica waking ``wakes[variant]`` seconds late."""
    w = point["wl"]
    for variant, make in models.items():
        sim = Simulator(engine_config, make(), model_config=model[0],
                        idle_wake_s=wakes[variant]).run(
            w, max_time_s=w.duration_s + c.max_drain_s)
        ss = sim.summary
        row[variant] = {name: ss.get(key) for name, key, _ in METRICS}
        row[f"{variant}_rel_error"] = {name: rel(ss.get(key), row["real"][name])
                                       for name, key, _ in METRICS}
        row[f"{variant}_saturated"] = saturated(ss, c)
        row[f"{variant}_in_real_ci"] = in_ci(row[variant], row["real_ci"])
        row[f"{variant}_wall_s"] = sim.wall_s
        row[f"{variant}_evidence"] = ss["evidence"]


def loo_models(c, steps_by_point: list, i: int) -> dict:
    """Models fitted on the real steps of every point except ``i`` (leave one out): measured in
    the same stretch of time as the point itself, never on the point's own steps."""
    rows = [r for j, rs in enumerate(steps_by_point) if j != i for r in rs]
    m = _fit_rows(rows)
    if m is None:
        print(f"note: no leave-one-out fit for point {i}")
        return {}
    shapes, times = [r[0] for r in rows], [r[1] for r in rows]
    q = ratio_quantiles(times, [m.time(sh) for sh in shapes])
    return {"sim_loo": lambda: m,
            "sim_loo_noisy": lambda: NoisyStepModel(m, q, seed=c.seed)}


def judge(rows, c, variant: str = "sim") -> dict:
    """Per workload: saturation rates and whether ``variant``'s errors below the real
    saturation meet the goal."""
    out = {}
    for name in dict.fromkeys(r["workload"] for r in rows):
        pts = sorted((r for r in rows if r["workload"] == name), key=lambda r: r["rate"])
        rates = [r["rate"] for r in pts]
        sat_real = next((i for i, r in enumerate(pts) if r["real_saturated"]), None)
        sat_sim = next((i for i, r in enumerate(pts) if r[f"{variant}_saturated"]), None)
        below = [r for i, r in enumerate(pts) if sat_real is None or i < sat_real]
        worst = {}
        for metric, _, _ in METRICS[:4]:
            errs = [abs(r[f"{variant}_rel_error"][metric]) for r in below
                    if r[f"{variant}_rel_error"][metric] is not None]
            worst[metric] = max(errs) if errs else None
        ok_p50 = all(worst[m] is not None and worst[m] <= c.goal_p50
                     for m in ("p50_ttft_ms", "p50_tpot_ms")) if below else None
        ok_p99 = all(worst[m] is not None and worst[m] <= c.goal_p99
                     for m in ("p99_ttft_ms", "p99_tpot_ms")) if below else None
        # Within one grid step; "never saturated" counts as the step past the grid's end.
        a = len(pts) if sat_real is None else sat_real
        b = len(pts) if sat_sim is None else sat_sim
        out[name] = {"rates": rates,
                     "saturation_rate_real": None if sat_real is None else rates[sat_real],
                     "saturation_rate_sim": None if sat_sim is None else rates[sat_sim],
                     "points_below_saturation": len(below),
                     "worst_abs_rel_error_below_saturation": worst,
                     "in_real_ci_below_saturation": {
                         m: sum(r[f"{variant}_in_real_ci"][m] for r in below) for m in CI_METRICS},
                     "meets_p50_goal": ok_p50, "meets_p99_goal": ok_p99,
                     "saturation_within_one_step": abs(a - b) <= 1}
    return out


def main(c, plan):
    out_dir = common.output_dir(c, "sim_validate")
    model = common.load_model(c.model)
    sm, cal = step_model(c, plan["engine"], model, out_dir)
    models = {"sim": lambda: sm}
    quantiles = (cal.get("fit") or {}).get("ratio_quantiles")
    if quantiles:  # the calibration's measured spread, one seeded generator per point
        models["sim_noisy"] = lambda: NoisyStepModel(sm, quantiles, seed=c.seed)
    # An idle engine admits an arrival this late: measured in the calibration's serving runs
    # (a grid calibration has only the sleep overshoot), per point below for the paired, self and
    # leave-one-out variants (in the runs their models were fitted on).
    wake_of = (lambda x, fallback: fallback if x is None else x) if c.model_idle_wake \
        else (lambda x, fallback: 0.0)
    wake = wake_of(cal.get("idle_admit_late_s"), cal["sleep_overshoot_s"])
    rows, steps, paired, lates, replays = [], [], [], [], []
    bar = common.Progress(len(plan["points"]), "[sim_validate real]", unit="point")
    for i, point in enumerate(plan["points"]):
        pm = {}
        if c.paired_calibration:
            pm, info = paired_models(c, plan["engine"], model, point, i)
        row, st, late = run_real(c, plan["engine"], model, point, replays)
        if c.paired_calibration:
            row["paired_calibration"] = info
        if c.repeat_real:
            add_repeat(row, run_real(c, plan["engine"], model, point, replays, " repeat")[0])
        rows.append(row)
        steps.append(st)
        lates.append(late)
        paired.append(pm)
        bar.update()
    bar.close()
    for i, (point, row) in enumerate(zip(plan["points"], rows)):
        variants = dict(models)
        variants.update(paired[i])
        if c.self_fit:
            m_self = _fit_rows(steps[i])
            if m_self is not None:
                variants["sim_self"] = lambda m=m_self: m
            m_alt = _fit_alt(c, steps[i])
            if m_alt is not None:
                variants["sim_self_alt"] = lambda m=m_alt: m
        if c.leave_one_out and len(rows) > 1:
            variants.update(loo_models(c, steps, i))
        wakes = dict.fromkeys(variants, wake)
        for v in variants:
            if v.startswith("sim_paired"):
                wakes[v] = wake_of(row.get("paired_calibration", {}).get("idle_admit_late_s"), wake)
            elif v.startswith("sim_self"):
                wakes[v] = wake_of(row["idle_admit_late_s"], wake)
            elif v.startswith("sim_loo"):
                wakes[v] = wake_of(_median([x for j, ls in enumerate(lates) if j != i for x in ls]),
                                   wake)
        row["idle_wake_s"] = wakes
        run_sims(c, plan["engine"], model, variants, point, row, wakes)
        for v in [*variants, *(["real_repeat"] if "real_repeat" in row else [])]:
            e = row[f"{v}_rel_error"]
            print(f"  {row['workload']:16s} {row['rate']:6.1f}/s  load {row['load_average']:4.1f}  "
                  f"{v:13s} " + "  ".join(f"{m} {_f(row['real'][m])}/{_f(row[v][m])} ({_p(e[m])})"
                                          for m, _, _ in METRICS[:4])
                  + f"  sat {row['real_saturated']}/{row[v + '_saturated']}", flush=True)
    names = [k[:-len("_evidence")] for k in rows[0] if k.endswith("_evidence") and k != "real_evidence"
             and all(k in r for r in rows)]  # variants every point has
    check_not_mixed([{"evidence": r["real_evidence"]} for r in rows])
    for v in names:
        check_not_mixed([{"evidence": r[f"{v}_evidence"]} for r in rows])
    verdict = {v: judge(rows, c, v) for v in names}  # real_repeat: the real engine's own floor
    for v, per in verdict.items():
        for name, j in per.items():
            print(f"{v:13s} {name}: saturation real {j['saturation_rate_real']} sim "
                  f"{j['saturation_rate_sim']}; worst |error| below saturation "
                  f"{({k: _pa(x) for k, x in j['worst_abs_rel_error_below_saturation'].items()})}; "
                  f"p50 goal {j['meets_p50_goal']}, p99 goal {j['meets_p99_goal']}, "
                  f"saturation within one step {j['saturation_within_one_step']}; in the real "
                  f"run's 95% interval at {j['in_real_ci_below_saturation']} of "
                  f"{j['points_below_saturation']} points")
    path = common.write_result(out_dir / "sim_validate.json", {
        "study": "sim_validate",
        "evidence": {"real": rows[0]["real_evidence"], "sim": rows[0]["sim_evidence"],
                     **({"real_repeat": rows[0]["real_repeat_evidence"]}
                        if "real_repeat_evidence" in rows[0] else {})},
        "variants": names, "step_models": {v: m().describe() for v, m in models.items()},
        "calibration": cal, "idle_wake_s": wake, "points": rows, "verdict": verdict,
        "config": c.to_dict(), "cpu_count": os.cpu_count(), "provenance": common.provenance()})
    print(f"wrote {path}")
    if serving.write_replay_records(out_dir / "replay.json", replays):  # the real runs
        print(f"replay: {replay_command(out_dir)}")


def _f(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _pa(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _p(v) -> str:
    return "-" if v is None else f"{100 * v:+.0f}%"


if __name__ == "__main__":
    common.run("sim_validate", main, check)
