"""Config of `experiments/capacity.py`: the highest request rate each arm serves within the SLO.

Launch::

    python -m experiments.capacity
    python -m experiments.capacity --config=experiments/configs/capacity.py:smoke
    python -m experiments.capacity --config.tpot_slo_ms=150 --config.rates="(1,2,4,8)"

Every arm sees the same requests (same seed) at each rate of the grid; an arm meets the SLO at a
rate when every request finished and p99 TTFT and p99 TPOT are within the SLO. Its capacity is the
highest grid rate at which it and every lower rate met the SLO. The ratio of the first arm's
capacity to the second's is the headline (paged + continuous over contiguous + static).
"""

import ml_collections

from experiments.configs import serve


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = serve.get_config("smoke" if arg == "smoke" else "default")
    c.rates = (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
    c.workload.num_requests = 48
    c.ttft_slo_ms = 1500.0
    c.tpot_slo_ms = 100.0
    c.max_wall_s = 90.0
    c.stop_after_failures = 2  # an arm stops sweeping after this many consecutive misses
    if arg == "smoke":
        c.rates = (5.0, 50.0)
        c.workload.num_requests = 4
        c.ttft_slo_ms = 5000.0
        c.tpot_slo_ms = 1000.0
        c.max_wall_s = 60.0
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
