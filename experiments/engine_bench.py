"""Engine step anatomy: decode steps/s and host overhead (schedule + batch build + postprocess).

Two regimes. ``steady``: fills the engine with ``num_running`` sequences, runs until every one is
decoding, then times decode steps (every step repeats the last one's batch: what the issue's
target is read on). ``churn``: ``churn_running`` sequences whose requests have random prompt and
output lengths, a new request queued for each that finishes, so every step mixes decodes, stops,
admissions and prefill chunks (what a saturated server does). Host time is measured per phase by the engine itself (``Engine.last_timing``); the
device phase is the jitted step until its sampled tokens are on the host. Reports medians.

On this machine the "device" is the same CPU: its step streams the KV pool through the caches, so
the host phases that follow it start cold. ``isolated_*`` repeats the timed steps with the device
call replaced by a stub that returns tokens of the right shape at once: the same host code on warm
caches, which is closer to what the host costs beside a real accelerator. The target is read on
the in-place figure (``median_host_ms``).
"""

from __future__ import annotations

import numpy as np
from absl import app
from ml_collections import config_flags

from experiments import common
from paged import Engine, EngineConfig, SamplingParams

_CONFIG = config_flags.DEFINE_config_file(
    "config", "experiments/configs/engine_bench.py", "Bench config.", lock_config=True)


class _Churn:
    """Keeps the engine saturated: requests of random prompt and output lengths, and a new one
    queued for each that finishes, so every step has stops, admissions and prefill chunks."""

    def __init__(self, engine: Engine, c, rng):
        self.engine, self.c, self.rng, self.count = engine, c, rng, 0

    def add(self) -> None:
        c, rng = self.c, self.rng
        prompt = [256] + rng.integers(0, 256, int(rng.integers(*c.churn_prompt_len)) - 1).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(*c.churn_max_tokens)), temperature=0.0,
                                ignore_eos=True)
        self.engine.add_request(f"c{self.count}", prompt, params)
        self.count += 1

    def step(self) -> None:
        for out in self.engine.step():
            if out.finished:
                self.add()


def bench_one(model_config, params, num_running: int, c, mode: str = "steady") -> dict:
    """Times engine steps with ``num_running`` sequences in flight: all decoding in lockstep
    (``steady``), or requests finishing and being replaced every step (``churn``)."""
    engine = Engine(EngineConfig(
        block_size=c.block_size, max_num_seqs=num_running,
        max_num_batched_tokens=max(num_running, 256) + (c.churn_chunk if mode == "churn" else 0),
        max_model_len=c.max_model_len, attention_impl=c.attention_impl,
        enable_prefix_caching=c.enable_prefix_caching),
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
        budget = c.max_model_len - c.prompt_len
        params_ = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        for i in range(num_running):
            engine.add_request(f"r{i}", [256] + rng.integers(0, 256, c.prompt_len - 1).tolist(),
                               params_)
        while engine.scheduler.waiting or any(not s.is_decoding for s in engine.scheduler.running):
            engine.step()
        for _ in range(c.warmup_steps):
            engine.step()
        step = engine.step
    def stub(params, cache, batch):  # no device work: tokens of the right shape, at once
        return cache, np.zeros(batch.sample_rows.shape, np.int32)

    # Rounds alternate in place and isolated blocks, so slow drifts of a shared machine show as
    # spread between rounds rather than as a bias of one figure.
    step_fn = engine._step_fn
    fast_before = engine.scheduler.num_fast_decode_steps
    run_before = engine.num_run_steps
    timings, isolated, rounds = [], [], []
    for _ in range(c.rounds):
        engine._step_fn = step_fn
        expect = num_running if mode == "steady" else None
        block = _timed_steps(engine, step, expect, c.steps)
        engine._step_fn = stub
        iso = _timed_steps(engine, step, expect, c.steps)
        timings += block
        isolated += iso
        rounds.append({"median_host_ms": 1e3 * float(np.median([t.host for t in block])),
                       "median_device_ms": 1e3 * float(np.median([t.device for t in block])),
                       "isolated_median_host_ms": 1e3 * float(np.median([t.host for t in iso]))})
    fast_steps = engine.scheduler.num_fast_decode_steps - fast_before
    run_steps = engine.num_run_steps - run_before

    def med(xs):
        return float(np.median(xs))

    host = [t.host for t in timings]
    total = [t.host + t.device for t in timings]
    return {
        "mode": mode,
        "num_running": num_running,
        "median_tokens_per_step": med([t.num_tokens for t in timings]),
        "steps": len(timings),
        "decode_steps_per_s": 1.0 / med(total),
        "output_tokens_per_s": num_running / med(total),
        "median_step_ms": 1e3 * med(total),
        "median_host_ms": 1e3 * med(host),
        "median_schedule_ms": 1e3 * med([t.schedule for t in timings]),
        "median_prepare_ms": 1e3 * med([t.prepare for t in timings]),
        "median_postprocess_ms": 1e3 * med([t.postprocess for t in timings]),
        "median_device_ms": 1e3 * med([t.device for t in timings]),
        "p90_host_ms": 1e3 * float(np.percentile(host, 90)),
        # The median hides rare heavy steps (in the steady regime every sequence fills a block on
        # the same step, and the block manager keys them all then): the mean and max show them.
        "mean_host_ms": 1e3 * float(np.mean(host)),
        "max_host_ms": 1e3 * float(np.max(host)),
        "host_share": med([h / s for h, s in zip(host, total)]),
        "host_us_per_seq": 1e6 * med(host) / num_running,
        "isolated_median_host_ms": 1e3 * med([t.host for t in isolated]),
        "isolated_median_schedule_ms": 1e3 * med([t.schedule for t in isolated]),
        "isolated_median_prepare_ms": 1e3 * med([t.prepare for t in isolated]),
        "isolated_median_postprocess_ms": 1e3 * med([t.postprocess for t in isolated]),
        "rounds": rounds,
        "batched_decode_steps": fast_steps,
        "decode_run_steps": run_steps,
        "num_compilations": engine.num_compilations,
    }


def _timed_steps(engine, step, num_running: int | None, steps: int) -> list:
    timings = []
    for _ in range(steps):
        step()
        t = engine.last_timing
        if num_running is not None and t.num_seqs != num_running:
            raise RuntimeError(f"expected {num_running} running sequences, stepped {t.num_seqs}")
        timings.append(t)
    return timings


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    c = _CONFIG.value
    model_config, params = common.load_model(c.model)
    rows = []
    for mode, n in [("steady", n) for n in c.num_running] + [("churn", n) for n in c.churn_running]:
        row = bench_one(model_config, params, n, c, mode)
        rows.append(row)
        print(f"{mode:6s} running={n:4d}  step {row['median_step_ms']:8.2f} ms  device {row['median_device_ms']:8.2f} ms"
              f"  host {row['median_host_ms']:6.3f} ms ({100 * row['host_share']:.1f}%: schedule "
              f"{row['median_schedule_ms']:.3f}, prepare {row['median_prepare_ms']:.3f}, post "
              f"{row['median_postprocess_ms']:.3f}; mean {row['mean_host_ms']:.3f}, max {row['max_host_ms']:.2f})  isolated host {row['isolated_median_host_ms']:.3f} ms"
              f"  {row['output_tokens_per_s']:.0f} tok/s", flush=True)
    out = c.output_json or str(common.results_dir("engine_bench") / "engine_bench.json")
    common.write_json(out, {"study": "engine_bench", "evidence": "constructed", "config": c.to_dict(),
                            "results": rows, "provenance": common.provenance()})
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
