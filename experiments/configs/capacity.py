"""Config of `experiments/capacity.py`: the highest request rate each arm serves within the SLO.

Launch::

    python -m experiments.capacity
    python -m experiments.capacity --config=experiments/configs/capacity.py:smoke
    python -m experiments.capacity --config.tpot_slo_ms=150 --config.rates="(1,2,4,8)"
    python -m experiments.capacity --config.workload.azure=conv --config.workload.window="(1200,1230)"

At each rate of the grid every arm sees the same requests (same seed), ``rate * duration_s`` of
them, so every point offers load for the same time and a rate beyond an arm's throughput shows
up as a growing queue rather than as a short burst it drains. An arm meets the SLO at a rate when
every request finished and p99 TTFT and p99 TPOT are within the SLO. Its capacity is the
highest grid rate at which it and every lower rate met the SLO. The ratio of the first arm's
capacity to the second's is the headline (paged + continuous over contiguous + static). With
``workload.azure`` every point is the same window of a real Azure trace (``evidence: real``, its
lengths scaled by ``workload.length_scale`` to ``max_model_len``) time-scaled to the point's rate
(``duration_s`` unused; ``workload.time_scale`` must stay 1).
"""

import ml_collections

from experiments.configs import serve


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = serve.get_config("smoke" if arg == "smoke" else "default")
    del c["real_arrivals"]  # serve's second (real-arrival) workload; a real trace: workload.azure
    c.rates = (2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)
    c.duration_s = 20.0  # offered load per point: num_requests = rate * duration_s
    c.ttft_slo_ms = 1500.0
    c.tpot_slo_ms = 100.0
    c.max_drain_s = 60.0  # wall limit per point: the last arrival + this (then in-flight is aborted)
    c.stop_after_failures = 2  # an arm stops sweeping after this many consecutive misses
    if arg == "smoke":
        c.rates = (5.0, 50.0)
        c.duration_s = 0.2
        c.ttft_slo_ms = 5000.0
        c.tpot_slo_ms = 1000.0
        c.max_drain_s = 60.0
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
