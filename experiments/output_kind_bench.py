"""The host cost of making every decoding request's output every step.

Two engines of the same settings (the bundled model, device call stubbed out with
`Engine.set_device_step`, so only host code runs) each hold ``num_running`` requests decoding in
lockstep. One engine's requests ask for ``SamplingParams(output_kind="cumulative")`` (a
`RequestOutput` per request per step, what a streaming server reads), the other's for
``"final_only"`` (none until a request finishes: what ``Engine.generate`` asks for). Blocks of
``steps`` steps alternate between the two (A B, then B A), so the ratio of their median step times
is measured under one load; the spread over rounds shows what is left. Each step's wall time and
its thread CPU time (``time.thread_time``: what the stepping thread itself spent, which other
processes on a shared machine disturb less) are both kept. Writes
``output_kind_bench.json`` with per-round medians, the ratio and the provenance.
"""

from __future__ import annotations

import os
import time

import numpy as np

from experiments import common
from paged import Engine, EngineConfig, SamplingParams
from paged.engine.device_step import stub_step

KINDS = ("cumulative", "final_only")


def check(c) -> dict:
    common.check_positive(prompt_len=c.prompt_len, max_model_len=c.max_model_len, steps=c.steps,
                          rounds=c.rounds)
    for n in c.num_running:
        common.check_positive(num_running=n)
    need = c.prompt_len + c.rounds * len(KINDS) * (c.steps + 1) // 2 + 2
    if need > c.max_model_len:
        raise ValueError(f"max_model_len={c.max_model_len} is too short for prompt_len="
                         f"{c.prompt_len} plus {c.rounds} rounds of {c.steps} steps (needs {need})")
    return {}


def _engine(model, c, n: int, kind: str) -> Engine:
    engine = Engine(EngineConfig(model=c.model, max_num_seqs=n, max_model_len=c.max_model_len,
                                 max_num_batched_tokens=max(n, 256), block_size=16),
                    model_config=model[0], params=model[1])
    engine.set_device_step(stub_step)
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=c.max_model_len - c.prompt_len, temperature=0.0,
                        ignore_eos=True, output_kind=kind)
    for i in range(n):
        engine.add_request(f"r{i}", rng.integers(0, 256, c.prompt_len).tolist(), sp)
    while engine.scheduler.waiting or any(not s.is_decoding for s in engine.scheduler.running):
        engine.step()
    return engine


def bench(model, c, n: int) -> dict:
    engines = {k: _engine(model, c, n, k) for k in KINDS}
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    rounds = []
    for i in range(c.rounds):
        row = {}
        for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
            step, block, block_cpu = engines[kind].step, [], []
            for _ in range(c.steps):
                t0, c0 = time.perf_counter(), time.thread_time()
                step()
                block_cpu.append(time.thread_time() - c0)
                block.append(time.perf_counter() - t0)
            times[kind] += block
            cpu[kind] += block_cpu
            row[f"{kind}_median_ms"] = 1e3 * float(np.median(block))
            row[f"{kind}_median_cpu_ms"] = 1e3 * float(np.median(block_cpu))
        row["ratio"] = row["final_only_median_ms"] / row["cumulative_median_ms"]
        row["cpu_ratio"] = row["final_only_median_cpu_ms"] / row["cumulative_median_cpu_ms"]
        rounds.append(row)
    out = {"num_running": n, "rounds": rounds}
    for key, series in (("", times), ("cpu_", cpu)):
        ratios = [r[f"{key}ratio"] for r in rounds]
        out.update({f"{k}_median_{key}ms": 1e3 * float(np.median(series[k])) for k in KINDS})
        out.update({f"{key}ratio_median": float(np.median(ratios)),
                    f"{key}ratio_min": float(min(ratios)), f"{key}ratio_max": float(max(ratios))})
    return out


def main(c, plan):
    out_dir = common.output_dir(c, "output_kind_bench")
    model = common.load_model(c.model)
    load_before = os.getloadavg()[0]
    results = []
    for n in c.num_running:
        r = bench(model, c, n)
        results.append(r)
        for key, what in (("", "wall"), ("cpu_", "thread CPU")):
            print(f"{n} running, {what}: host step {r[f'cumulative_median_{key}ms']:.3f} ms "
                  f"cumulative, {r[f'final_only_median_{key}ms']:.3f} ms final_only; ratio "
                  f"{r[f'{key}ratio_median']:.3f} [{r[f'{key}ratio_min']:.3f}, "
                  f"{r[f'{key}ratio_max']:.3f}] over {c.rounds} rounds")
    prov = common.provenance()
    prov["load_average"] = [load_before, os.getloadavg()[0]]
    path = common.write_result(out_dir / "output_kind_bench.json", {
        "study": "output_kind_bench", "evidence": "constructed", "results": results,
        "config": c.to_dict(), "provenance": prov})
    print(f"wrote {path}")


if __name__ == "__main__":
    common.run("output_kind_bench", main, check)
