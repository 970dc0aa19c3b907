"""Calibration: measure the real engine's step times over a grid of shapes, fit a step-time model.

Two ways to measure (``config.mode``): ``grid`` (below: steps of chosen shapes, timed one by one)
and ``serving`` (the step periods of real-time serving runs of constructed workloads, recorded by
wrapping ``engine.scheduler.schedule`` and ``engine.step``: schedule call to the next step's,
while the engine stayed busy; it holds the driver's own work between steps, which a grid does
not). Both fit the same form.

Each measured step is one ``Engine.step()`` with ``async_scheduling=False`` (schedule, build,
device call, read back: the whole period a serial engine spends per step), timed by wall clock and
split by ``Engine.last_timing`` into host and device parts. Its shape is read from the scheduler's
output before the step is committed (``paged.sim.replica.step_shape``, the function the simulator
uses), through a wrapper around ``engine.scheduler.schedule``.

The fit (``paged.sim.linear_model.fit_linear``, relative least squares, one row per grid point:
mean shape, median time) is
``t = a + b * tokens + c * seqs + d * kv_read`` by default; the alternative forms in
``config.alt_features`` are fitted too and their residuals reported, so the choice is visible.
Output: ``calibration.json`` with the coefficients (``"model"``, loadable by
``paged.sim.load_model_json``), every point, the residuals, the machine's load average and
provenance. Evidence ``constructed`` (measured on constructed inputs).
"""

from __future__ import annotations

import os
import time

import numpy as np

from experiments import common
from paged import Engine, SamplingParams
from paged.sim.batches import step_shape
from paged.sim.linear_model import FEATURES, fit_linear
from paged.sim.measured import ratio_quantiles
from paged.sim.step_model import StepShape


def check(c) -> dict:
    common.check_model(c.model)
    engine_config = common.make_engine_config(c.engine, model=c.model)
    if engine_config.async_scheduling:
        raise ValueError("engine.async_scheduling=True: calibration measures serial steps "
                         "(the simulator's semantics); set it to False")
    for key in ("decode_batch_sizes", "context_lens", "prefill_chunks"):
        vals = tuple(c[key])
        if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
            raise ValueError(f"{key}={vals!r} must be a non-empty tuple of ints >= 1")
    if isinstance(c.keep_points, bool) or not isinstance(c.keep_points, int) or c.keep_points < 1:
        raise ValueError(f"keep_points={c.keep_points!r} must be an int >= 1")
    if c.mode not in ("grid", "serving"):
        raise ValueError(f"mode={c.mode!r} must be 'grid' (a grid of batch shapes) or 'serving' "
                         "(step periods of real-time serving runs)")
    if c.mode == "serving":
        if not c.serving_workloads:
            raise ValueError("serving_workloads=() names no workload")
        common.check_positive(serving_duration_s=c.serving_duration_s)
        if c.serving_weights not in ("absolute", "relative"):
            raise ValueError(f"serving_weights={c.serving_weights!r} must be 'absolute' or "
                             "'relative'")
    if c.aggregate not in ("median", "none"):
        raise ValueError(f"aggregate={c.aggregate!r} must be 'median' (one row per grid point) or "
                         "'none' (every step)")
    if c.warmup not in ("grid", "all"):
        raise ValueError(f"warmup={c.warmup!r} must be 'grid' (an unmeasured pass over the grid) "
                         "or 'all' (Engine.warmup: every shape)")
    for key in ("steps", "repeats"):
        if isinstance(c[key], bool) or not isinstance(c[key], int) or c[key] < 1:
            raise ValueError(f"{key}={c[key]!r} must be an int >= 1")
    for f in (c.features, c.serving_features, *c.alt_features):
        unknown = sorted(set(f) - set(FEATURES))
        if unknown:
            raise ValueError(f"features {tuple(f)}: unknown {unknown}; known: {sorted(FEATURES)}")
    if c.mode == "serving":  # the grid is not used
        return {"engine": engine_config}
    if max(c.decode_batch_sizes) > engine_config.max_num_seqs:
        raise ValueError(f"decode_batch_sizes={tuple(c.decode_batch_sizes)} exceeds "
                         f"engine.max_num_seqs={engine_config.max_num_seqs}")
    if max(c.context_lens) + c.steps + c.warmup_steps + 2 > engine_config.max_model_len:
        raise ValueError(f"context_lens={tuple(c.context_lens)} + steps leave no room in "
                         f"engine.max_model_len={engine_config.max_model_len}")
    if max(c.prefill_chunks) > engine_config.max_num_batched_tokens or \
            max(c.prefill_chunks) >= engine_config.max_model_len:
        raise ValueError(f"prefill_chunks={tuple(c.prefill_chunks)} must fit one step "
                         f"(engine.max_num_batched_tokens={engine_config.max_num_batched_tokens}) "
                         f"and max_model_len")
    return {"engine": engine_config}


class Recorder:
    """Wraps ``engine.scheduler.schedule``: the shape of each step, read before it is committed."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.shapes = []
        inner = engine.scheduler.schedule

        def schedule(now):
            out = inner(now)
            self.shapes.append(None if out.is_empty else
                               step_shape(engine.batch, engine.builder, out))
            return out

        engine.scheduler.schedule = schedule

    def close(self) -> None:
        del self.engine.scheduler.schedule  # the bound method again

    def step(self):
        """One timed step: (shape, wall seconds, host seconds), shape None if nothing ran."""
        n = len(self.shapes)
        t = time.perf_counter()
        outs = self.engine.step()
        wall = time.perf_counter() - t
        shape = self.shapes[n] if len(self.shapes) > n else None
        return shape, wall, self.engine.last_timing.host, outs


class ServingRecorder:
    """Records, for every step of a real-time serving run, its shape and its *period*: the wall
    time from its ``schedule`` call to the next step's when the engine had work left after it
    (the period then holds the driver's own work between steps: admitting arrivals, recording
    outputs), else the step's own wall time (the driver sleeps after it). A step that follows
    such a pause is marked ``after_idle``. That period is what a simulated step lasts.

    It also records, for each request added while the engine had nothing to do, how late the
    driver added it (``admit_late``: ``add_request`` time minus the arrival time): the wake-up
    from its sleep plus the loop's own work before admission, which a simulated idle replica
    pays as ``Simulator(idle_wake_s=...)``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.rows = []  # (shape, period)
        self.admit_late = []  # seconds, requests that arrived to an idle engine
        self._last = None  # (shape, start) of the previous step, if the engine stayed busy
        self._idle = True
        self._pending = None
        inner_schedule, inner_step = engine.scheduler.schedule, engine.step

        def schedule(now):
            t = time.perf_counter()
            out = inner_schedule(now)
            if self._last is not None:
                self.rows.append((self._last[0], t - self._last[1]))
                self._last = None
            self._pending = None if out.is_empty else (
                step_shape(engine.batch, engine.builder, out, after_idle=self._idle), t)
            return out

        def step():
            self._pending = None
            outs = inner_step()
            busy = engine.has_unfinished_requests()
            if busy:
                self._last = self._pending
            elif self._pending is not None:
                self.rows.append((self._pending[0], time.perf_counter() - self._pending[1]))
            if self._pending is not None or not busy:
                self._idle = not busy
            return outs

        inner_add = engine.add_request

        def add_request(request_id, prompt, params=None, *, arrival_time=None, **kw):
            t = time.perf_counter()
            if arrival_time is not None and not engine.has_unfinished_requests():
                self.admit_late.append(t - arrival_time)
            return inner_add(request_id, prompt, params, arrival_time=arrival_time, **kw)

        engine.scheduler.schedule = schedule
        engine.step = step
        engine.add_request = add_request

    def close(self) -> None:
        del self.engine.scheduler.schedule
        del self.engine.step
        del self.engine.add_request


def measure_serving(c, engine_config, model) -> tuple[list[dict], list[float]]:
    """Step periods of real-time serving runs (``serving_workloads``: kind, shared prefix, rate),
    on workloads drawn with ``seed + 1000`` (not the requests a validation then serves), and the
    admission lateness of requests that found the engine idle (``ServingRecorder.admit_late``)."""
    from experiments import serving
    from paged.workload.workload import make_workload

    points, late = [], []
    for kind, prefix, rate in c.serving_workloads:
        w = make_workload(kind, max(2, round(rate * c.serving_duration_s)), float(rate),
                          max_model_len=engine_config.max_model_len, seed=c.seed + 1000,
                          shared_prefix_len=int(prefix))
        engine = serving.build_engine(engine_config, model)
        rec = ServingRecorder(engine)
        try:
            serving.run_arm(f"calibrate {kind}@{rate:g}", engine, w, progress=False,
                            max_wall_s=w.duration_s + 30.0)
        finally:
            rec.close()
        points += [_point("serving", shape, period, 0.0, shape.num_seqs, f"{kind}@{rate:g}")
                   for shape, period in rec.rows]
        late += rec.admit_late
    return points, late


def _prompt(rng, n: int) -> list[int]:
    return [256] + rng.integers(0, 256, n - 1).tolist()


def _drain(engine: Engine) -> None:
    for rid in engine.unfinished_request_ids():
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # reports the aborted requests


def measure(engine: Engine, c, rng) -> list[dict]:
    rec = Recorder(engine)
    points = []
    try:
        _measure(engine, c, rng, rec, points)
    finally:
        rec.close()
    return points


def _measure(engine, c, rng, rec, points) -> None:
    total = len(c.decode_batch_sizes) * len(c.context_lens) + len(c.prefill_chunks) * c.repeats
    with common.Progress(total, "calibrate", unit="point") as progress:
        _measure_points(engine, c, rng, rec, points, progress)


def _measure_points(engine, c, rng, rec, points, progress) -> None:
    k = 0
    for b in c.decode_batch_sizes:
        for ctx in c.context_lens:
            for _ in range(b):
                k += 1
                # Long enough that no sequence finishes before the point is measured.
                engine.add_request(f"d{k}", _prompt(rng, ctx), SamplingParams(
                    max_tokens=engine.config.max_model_len - ctx, ignore_eos=True))
            # Prefill (chunked by the token budget) until every sequence decodes; those steps are
            # measured too (mixed and prefill shapes).
            while any(not s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
                shape, wall, host, _ = rec.step()
                if shape is not None:
                    points.append(_point("prefill_of_decode_point", shape, wall, host, b, ctx))
            for i in range(c.warmup_steps + c.steps):
                shape, wall, host, _ = rec.step()
                if i >= c.warmup_steps and shape is not None:
                    points.append(_point("decode", shape, wall, host, b, ctx))
            _drain(engine)
            progress.update(1)
    for chunk in c.prefill_chunks:
        for _ in range(c.repeats):
            k += 1
            engine.add_request(f"p{k}", _prompt(rng, chunk), SamplingParams(max_tokens=1,
                                                                             ignore_eos=True))
            shape, wall, host, _ = rec.step()
            if shape is not None:
                points.append(_point("prefill", shape, wall, host, 1, chunk))
            _drain(engine)
            progress.update(1)


def _point(kind, shape, wall, host, batch, ctx) -> dict:
    return {"kind": kind, "batch": batch, "context": ctx, "wall_s": wall, "host_s": host,
            "shape": shape.as_dict(), "_shape": shape}


def sleep_overshoot(n: int = 50, nap_s: float = 0.002) -> float:
    """Median lateness of ``time.sleep(nap_s)``: how late a real-time driver wakes for an arrival
    when its engine is idle (the simulator's ``idle_wake_s``)."""
    late = []
    for _ in range(n):
        t = time.perf_counter()
        time.sleep(nap_s)
        late.append(time.perf_counter() - t - nap_s)
    return float(np.median(late))


def aggregate(points: list[dict]) -> tuple[list[StepShape], list[float]]:
    """One row per grid point (kind, batch, context): the mean shape and the median time (the
    median keeps a step that another process delayed from pulling the fit)."""
    groups: dict = {}
    for p in points:
        key = (p["kind"], p["batch"], p["context"])
        if p["kind"] == "prefill_of_decode_point":  # chunked prefills beside decodes: by shape
            key += (p["_shape"].num_tokens, p["_shape"].num_seqs)
        groups.setdefault(key, []).append(p)
    shapes, times = [], []
    for rows in groups.values():
        fields = rows[0]["_shape"].as_dict().keys()
        mean = {f: round(float(np.mean([getattr(r["_shape"], f) for r in rows]))) for f in fields}
        shapes.append(StepShape(**mean))
        times.append(float(np.median([r["wall_s"] for r in rows])))
    return shapes, times


def fit_all(points: list[dict], c) -> dict:
    if c.get("aggregate", "median") == "median":
        shapes, times = aggregate(points)
    else:
        shapes, times = [p["_shape"] for p in points], [p["wall_s"] for p in points]
    model = fit_linear(shapes, times, tuple(c.features))
    alts = []
    for f in c.alt_features:
        try:
            m = fit_linear(shapes, times, tuple(f))
            alts.append({"features": list(f), "coef": m.coef,
                         **{k: v for k, v in m.fit.items() if k != "residuals_s"}})
        except ValueError as e:
            alts.append({"features": list(f), "error": str(e)})
    return {"model": model, "alternatives": alts}


def calibrate(c, engine_config, model) -> tuple:
    """Measures the grid on a fresh engine and fits; returns ``(StepTimeModel, payload)`` where
    the payload is what ``calibration.json`` holds."""
    if c.mode == "serving":
        return _calibrate_serving(c, engine_config, model)
    engine = Engine(engine_config, model_config=model[0], params=model[1])
    t0 = time.perf_counter()
    if c.warmup == "all":
        engine.warmup(logprobs=False, parallel_sampling=False)
    else:  # one unmeasured pass over the grid compiles exactly the shapes it uses
        measure(engine, c, np.random.default_rng(c.seed + 1))
    warm_s = time.perf_counter() - t0
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    points = measure(engine, c, np.random.default_rng(c.seed))
    measure_s = time.perf_counter() - t0
    load_after = os.getloadavg()
    wake = sleep_overshoot()
    fits = fit_all(points, c)
    model = fits["model"]
    for p in points:
        p["predicted_s"] = model.time(p.pop("_shape"))
    fit = model.fit
    print(f"calibration: {len(points)} steps measured in {measure_s:.1f} s (warmup {warm_s:.1f} s), "
          f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print(f"sleep overshoot (idle wake-up) {wake * 1e3:.3f} ms")
    print("fit  t = " + " + ".join(f"{v:.3e}*{k}" for k, v in model.coef.items()))
    print(f"     rms rel error {fit['rms_rel_error']:.3f}, median |rel| "
          f"{fit['median_abs_rel_error']:.3f}, max |rel| {fit['max_abs_rel_error']:.3f}, "
          f"R^2 {fit['r2']}")
    for a in fits["alternatives"]:
        if "error" in a:
            print(f"alt  {a['features']}: {a['error']}")
        else:
            print(f"alt  {a['features']}: rms rel {a['rms_rel_error']:.3f}, median |rel| "
                  f"{a['median_abs_rel_error']:.3f}")
    payload = {
        "study": "calibrate", "evidence": "constructed",
        "what": "step wall time of Engine.step() with async_scheduling=False on this machine",
        "model": model.to_json(), "alternatives": fits["alternatives"],
        "engine_config": dict(engine_config.__dict__), "model_name": c.model,
        "load_average_before": load_before, "load_average_after": load_after,
        "cpu_count": os.cpu_count(), "warmup_s": warm_s, "measure_s": measure_s,
        "points": points, "sleep_overshoot_s": wake,
        "config": c.to_dict(), "provenance": common.provenance()}
    return model, payload


def _calibrate_serving(c, engine_config, model) -> tuple:
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    points, late = measure_serving(c, engine_config, model)
    measure_s = time.perf_counter() - t0
    load_after = os.getloadavg()
    shapes, times = [p["_shape"] for p in points], [p["wall_s"] for p in points]
    # Plain least squares: the fit follows the mean period (what throughput and TPOT average
    # over), not the typical one; steps another process stretched stay in.
    model_fit = fit_linear(shapes, times, tuple(c.serving_features), weights=c.serving_weights)
    pred = [model_fit.time(sh) for sh in shapes]
    model_fit.fit["ratio_quantiles"] = ratio_quantiles(times, pred)
    for p in points:
        p["predicted_s"] = model_fit.time(p.pop("_shape"))
    fit = model_fit.fit
    wake = sleep_overshoot()
    admit = float(np.median(late)) if late else None
    q = fit["ratio_quantiles"]
    print(f"calibration (serving): {len(points)} step periods in {measure_s:.1f} s, "
          f"measured/predicted p1 {q[2]:.2f} p50 {q[128]:.2f} p99 {q[-3]:.2f}, load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print("fit  t = " + " + ".join(f"{v:.3e}*{k}" for k, v in model_fit.coef.items()))
    if admit is not None:
        print(f"     idle admission lateness (median of {len(late)}) {admit * 1e3:.3f} ms, "
              f"sleep overshoot {wake * 1e3:.3f} ms")
    print(f"     rms rel error {fit['rms_rel_error']:.3f}, median |rel| "
          f"{fit['median_abs_rel_error']:.3f}, max |rel| {fit['max_abs_rel_error']:.3f}")
    fit["residuals_s"] = fit["residuals_s"][:0]  # per-point predictions are in ``points``
    payload = {
        "study": "calibrate", "evidence": "constructed", "mode": "serving",
        "what": "step periods of real-time serving runs (schedule call to the next, engine busy)",
        "model": model_fit.to_json(), "engine_config": dict(engine_config.__dict__),
        "model_name": c.model, "load_average_before": load_before,
        "load_average_after": load_after, "cpu_count": os.cpu_count(), "measure_s": measure_s,
        "points": points, "sleep_overshoot_s": wake, "idle_admit_late_s": admit,
        "idle_admit_late_count": len(late), "config": c.to_dict(),
        "provenance": common.provenance()}
    return model_fit, payload


def thin(payload: dict, keep: int) -> dict:
    """The payload with at most ``keep`` of its points (evenly spaced; the fit used them all),
    so a committed result stays small; ``num_points_measured`` says how many there were."""
    pts = payload["points"]
    payload["num_points_measured"] = len(pts)
    if len(pts) > keep:
        idx = np.linspace(0, len(pts) - 1, keep).round().astype(int)
        payload["points"] = [pts[i] for i in idx]
        payload["points_note"] = f"{keep} of {len(pts)} measured points, evenly spaced"
    return payload


def main(c, plan):
    out_dir = common.output_dir(c, "calibrate")
    _, payload = calibrate(c, plan["engine"], common.load_model(c.model))
    path = common.write_result(out_dir / "calibration.json", thin(payload, c.keep_points))
    print(f"wrote {path}")


if __name__ == "__main__":
    common.run("calibrate", main, check)
