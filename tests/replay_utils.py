"""A serving run worth replaying, made deterministic: the small engine settings, a workload with
a shared prefix (prefix-cache hits), and a stand-in clock under which a serving run (arrivals,
timeout, wall limit) is the same on any machine. Shared by the replay tests, in this process
and in forced-device subprocesses."""

from __future__ import annotations

import time

import numpy as np

from experiments import serving
from paged.workload.workload import RequestSpec, Workload

CONFIG = dict(block_size=8, num_blocks=14, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=64, model="random-small",
              min_token_bucket=32, min_seq_bucket=4)  # one step shape: few compilations


def workload(num: int = 30, gap_s: float = 0.08) -> Workload:
    rng = np.random.default_rng(3)
    shared = [256] + rng.integers(0, 256, 16).tolist()  # two full blocks: prefix-cache hits
    reqs = []
    for i in range(num):
        prompt = shared + rng.integers(0, 256, int(rng.integers(3, 20))).tolist()
        reqs.append(RequestSpec(f"r{i:02d}", i * gap_s, tuple(prompt), None, len(prompt),
                                int(rng.integers(8, 26))))
    return Workload("replay-test", tuple(reqs), "constructed", 3)


class Clock:
    """A deterministic stand-in for the wall clock: every read advances it 0.1 ms, a sleep by
    its length; so the serving run (arrivals, timeout, wall limit) is the same on any machine."""

    def __init__(self):
        self.t = 100.0

    def perf_counter(self) -> float:
        self.t += 1e-4
        return self.t

    def sleep(self, d: float) -> None:
        self.t += max(0.0, d)


def run_on_clock(name, engine, wl: Workload, **kwargs) -> serving.ArmResult:
    """``serving.run_arm`` under a new ``Clock`` (restored after)."""
    clock, real = Clock(), (time.perf_counter, time.sleep)
    time.perf_counter, time.sleep = clock.perf_counter, clock.sleep
    try:
        return serving.run_arm(name, engine, wl, progress=False, **kwargs)
    finally:
        time.perf_counter, time.sleep = real
