"""Engine step anatomy: decode steps/s and host overhead (schedule + batch build + postprocess).

Two regimes. ``steady``: fills the engine with ``num_running`` sequences, runs until every one is
decoding, then times decode steps (every step repeats the last one's batch: what the issue's
target is read on). ``churn``: ``churn_running`` sequences whose requests have random prompt and
output lengths, a new request queued for each that finishes, so every step mixes decodes, stops,
admissions and prefill chunks (what a saturated server does). Host time is measured per phase by
the engine itself (``Engine.last_timing``); the device phase is the wait for a step's sampled
tokens. Each round times a block of steps with the overlapped step on (``async_scheduling``: step
k+1 is scheduled and dispatched before step k is read back), one with it off (serial: host, then
device), and one with the device call stubbed out; the wall time of each ``step()`` call is the
step time. Reports medians; ``step_over_max_device_host`` is the overlapped step against
max(device, host) of the serial one, ``host_share_hidden`` the part of the serial host time the
overlap took off the step.

On this machine the "device" is the same CPU: its step streams the KV pool through the caches, so
the host phases that follow it start cold. ``isolated_*`` repeats the timed steps with the device
call replaced by a stub that returns tokens of the right shape at once: the same host code on warm
caches, which is closer to what the host costs beside a real accelerator. The target is read on
the in-place figure (``median_host_ms``).
"""

from __future__ import annotations

import time

import numpy as np

from experiments import common
from paged import Engine, EngineConfig, SamplingParams
from paged.engine.device_step import stub_step


class _Churn:
    """Keeps the engine saturated: requests of random prompt and output lengths, and a new one
    queued for each that finishes, so every step has stops, admissions and prefill chunks."""

    def __init__(self, engine: Engine, c, rng):
        self.engine, self.c, self.rng, self.count = engine, c, rng, 0

    def add(self) -> None:
        c, rng = self.c, self.rng
        prompt = random_prompt(rng, int(rng.integers(*c.churn_prompt_len)),
                               self.engine.model_config.vocab_size)
        params = SamplingParams(max_tokens=int(rng.integers(*c.churn_max_tokens)), temperature=0.0,
                                ignore_eos=True)
        self.engine.add_request(f"c{self.count}", prompt, params)
        self.count += 1

    def step(self) -> None:
        for out in self.engine.step():
            if out.finished:
                self.add()


def engine_config(c, num_running: int, mode: str) -> EngineConfig:
    """``config.engine`` with the run's sequence and token budgets."""
    return common.make_engine_config(
        c.engine, model=c.model, max_num_seqs=num_running,
        max_num_batched_tokens=max(num_running, 256) + (c.churn_chunk if mode == "churn" else 0))


def runs(c) -> list[tuple[str, int]]:
    return [("steady", n) for n in c.num_running] + [("churn", n) for n in c.churn_running]


def check(c) -> dict:
    """Checks every setting and builds each run's EngineConfig (no model yet)."""
    common.check_model(c.model)
    common.check_unset(c.engine, ["max_num_seqs", "max_num_batched_tokens"],
                       "num_running / churn_running")
    for key in ("warmup_steps", "churn_warmup_steps", "churn_chunk"):
        if isinstance(c[key], bool) or c[key] < 0:
            raise ValueError(f"{key}={c[key]!r} must be an integer >= 0")
    for key in ("steps", "rounds", "prompt_len"):
        if isinstance(c[key], bool) or c[key] < 1:
            raise ValueError(f"{key}={c[key]!r} must be an integer >= 1")
    if c.prompt_len >= c.engine.max_model_len:
        raise ValueError(f"prompt_len={c.prompt_len} must be < engine.max_model_len="
                         f"{c.engine.max_model_len}")
    for key in ("churn_prompt_len", "churn_max_tokens"):
        low, high = (tuple(c[key]) + (None, None))[:2]
        if len(c[key]) != 2 or not (isinstance(low, int) and isinstance(high, int)
                                    and 1 <= low < high):
            raise ValueError(f"{key}={tuple(c[key])!r} must be (low, high) with 1 <= low < high")
    if c.churn_prompt_len[1] - 1 + c.churn_max_tokens[1] - 1 > c.engine.max_model_len:
        raise ValueError(f"churn_prompt_len={tuple(c.churn_prompt_len)} and churn_max_tokens="
                         f"{tuple(c.churn_max_tokens)} can exceed engine.max_model_len="
                         f"{c.engine.max_model_len}")
    if not runs(c):
        raise ValueError("num_running=() and churn_running=() name no run")
    for key in ("num_running", "churn_running"):
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in c[key]):
            raise ValueError(f"{key}={tuple(c[key])!r} must be positive integers")
    return {"engines": [(mode, n, engine_config(c, n, mode)) for mode, n in runs(c)]}


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    """``length`` random token ids: the byte tokenizer's BOS (256) then bytes, or for a model
    without those ids (a small checkpoint) ids below ``vocab_size``."""
    if vocab_size > 256:
        return [256] + rng.integers(0, 256, length - 1).tolist()
    return rng.integers(0, vocab_size, length).tolist()


def bench_one(model_config, params, num_running: int, c, mode: str = "steady",
              config: EngineConfig | None = None) -> dict:
    """Times engine steps with ``num_running`` sequences in flight: all decoding in lockstep
    (``steady``), or requests finishing and being replaced every step (``churn``)."""
    engine = Engine(config or engine_config(c, num_running, mode),
                    model_config=model_config, params=params)
    rng = np.random.default_rng(0)
    if mode == "churn":
        churn = _Churn(engine, c, rng)
        for _ in range(2 * num_running):  # as many waiting as running
            churn.add()
        for _ in range(c.churn_warmup_steps):  # until lengths are mixed
            churn.step()
        step = churn.step
    else:
        budget = c.engine.max_model_len - c.prompt_len
        params_ = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        for i in range(num_running):
            engine.add_request(f"r{i}", random_prompt(rng, c.prompt_len,
                                                      engine.model_config.vocab_size), params_)
        while engine.scheduler.waiting or any(not s.is_decoding for s in engine.scheduler.running):
            engine.step()
        for _ in range(c.warmup_steps):
            engine.step()
        step = engine.step
    # Rounds interleave blocks with overlap on, overlap off, and the device call stubbed out, so
    # slow drifts of a shared machine show as spread between rounds rather than as a bias of one
    # figure.
    fast_before = engine.scheduler.num_fast_decode_steps
    expect = num_running if mode == "steady" else None
    blocks = {"on": [], "off": [], "isolated": []}
    walls = {"on": [], "off": []}
    rounds = []
    for i in range(c.rounds):
        row = {}
        # A B, then B A: in the steady regime every step is longer than the last (the context
        # grows), so the order alternates and per-round ratios cancel the drift.
        for name in ("on", "off", "isolated") if i % 2 == 0 else ("off", "on", "isolated"):
            engine.set_device_step(stub_step if name == "isolated" else None)
            engine.async_scheduling = name == "on"
            step()  # the switch (its step reads back the last mode's step)
            block, wall = _timed_steps(engine, step, expect, c.steps)
            blocks[name] += block
            if name in walls:
                walls[name] += wall
                row[f"{name}_median_step_ms"] = 1e3 * float(np.median(wall))
            row[f"{name}_median_host_ms"] = 1e3 * float(np.median([t.host for t in block]))
        row["speedup"] = row["off_median_step_ms"] / row["on_median_step_ms"]
        rounds.append(row)
    engine.set_device_step(None)
    engine.async_scheduling = engine.config.async_scheduling
    fast_steps = engine.scheduler.num_fast_decode_steps - fast_before

    def med(xs):
        return float(np.median(xs))

    timings, off, isolated = blocks["on"], blocks["off"], blocks["isolated"]
    host = [t.host for t in timings]
    host_off = [t.host for t in off]
    dev_off = [t.device for t in off]
    step_on, step_off = med(walls["on"]), med(walls["off"])
    bound = max(med(dev_off), med(host_off))
    return {
        "mode": mode,
        "num_running": num_running,
        "median_tokens_per_step": med([t.num_tokens for t in timings]),
        "steps": len(timings),
        # Wall time per step() call: with overlap the host works while the device runs.
        "median_step_ms": 1e3 * step_on,
        "off_median_step_ms": 1e3 * step_off,
        "decode_steps_per_s": 1.0 / step_on,
        "output_tokens_per_s": num_running / step_on,
        "off_output_tokens_per_s": num_running / step_off,
        # Median of per-round serial/overlapped ratios (rounds alternate the order).
        "overlap_speedup": med([r["speedup"] for r in rounds]),
        "overlap_speedup_rounds": [r["speedup"] for r in rounds],
        # Overlap's target: a step costs at most 1.1 x max(device, host) of the serial step.
        "step_over_max_device_host": step_on / bound,
        # How much of the serial step's host time the overlap took off the step.
        "host_share_hidden": min(1.0, max(0.0, (step_off - step_on) / med(host_off))),
        "median_host_ms": 1e3 * med(host),
        "median_schedule_ms": 1e3 * med([t.schedule for t in timings]),
        "median_prepare_ms": 1e3 * med([t.prepare for t in timings]),
        "median_postprocess_ms": 1e3 * med([t.postprocess for t in timings]),
        "median_device_wait_ms": 1e3 * med([t.device for t in timings]),
        "p90_host_ms": 1e3 * float(np.percentile(host, 90)),
        # The median hides rare heavy steps (in the steady regime every sequence fills a block on
        # the same step, and the block manager keys them all then): the mean and max show them.
        "mean_host_ms": 1e3 * float(np.mean(host)),
        "max_host_ms": 1e3 * float(np.max(host)),
        "off_median_host_ms": 1e3 * med(host_off),
        "off_median_device_ms": 1e3 * med(dev_off),
        "off_host_share": med([h / (h + d) for h, d in zip(host_off, dev_off)]),
        "host_us_per_seq": 1e6 * med(host) / num_running,
        "isolated_median_host_ms": 1e3 * med([t.host for t in isolated]),
        "isolated_median_schedule_ms": 1e3 * med([t.schedule for t in isolated]),
        "isolated_median_prepare_ms": 1e3 * med([t.prepare for t in isolated]),
        "isolated_median_postprocess_ms": 1e3 * med([t.postprocess for t in isolated]),
        "rounds": rounds,
        "batched_decode_steps": fast_steps,
        "num_compilations": engine.num_compilations,
    }


def _timed_steps(engine, step, num_running: int | None, steps: int) -> tuple[list, list[float]]:
    """Each step's phase timings and its wall time (the whole ``step()`` call)."""
    timings, walls = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
        t = engine.last_timing
        if num_running is not None and t.num_seqs != num_running:
            raise RuntimeError(f"expected {num_running} running sequences, stepped {t.num_seqs}")
        timings.append(t)
    return timings, walls


def main(c, plan):
    out_dir = common.output_dir(c, "engine_bench")
    model_config, params = common.load_model(c.model)
    rows = []
    bar = common.Progress(len(plan["engines"]), "[engine_bench]", unit="regime")
    for mode, n, config in plan["engines"]:
        row = bench_one(model_config, params, n, c, mode, config)
        rows.append(row)
        bar.update()
        print(f"{mode:6s} running={n:4d}  step {row['median_step_ms']:8.2f} ms (serial "
              f"{row['off_median_step_ms']:.2f}: device {row['off_median_device_ms']:.2f} + host "
              f"{row['off_median_host_ms']:.3f})  host {row['median_host_ms']:6.3f} ms (schedule "
              f"{row['median_schedule_ms']:.3f}, prepare {row['median_prepare_ms']:.3f}, post "
              f"{row['median_postprocess_ms']:.3f}; mean {row['mean_host_ms']:.3f}, max "
              f"{row['max_host_ms']:.2f})  isolated host {row['isolated_median_host_ms']:.3f} ms  "
              f"step/max(device, host) {row['step_over_max_device_host']:.2f}  "
              f"{row['output_tokens_per_s']:.0f} tok/s", flush=True)
    bar.close()
    out = out_dir / "engine_bench.json"
    common.write_result(out, {"study": "engine_bench", "evidence": "constructed", "config": c.to_dict(),
                            "results": rows, "provenance": common.provenance()})
    print(f"wrote {out}")


if __name__ == "__main__":
    common.run("engine_bench", main, check)
