"""Config of `experiments/sliding_window_capacity.py`: capacity at the SLO, full vs windows.

Launch::

    python -m experiments.sliding_window_capacity
    python -m experiments.sliding_window_capacity --config=experiments/configs/sliding_window_capacity.py:smoke
    python -m experiments.sliding_window_capacity --config.rates="(1,2,3,4)" --config.duration_s=20

The arms and the pool are `experiments/configs/sliding_window.py`'s (the bundled tiny model, its
trained weights served with full attention and with every layer sliding at 1/8, 1/4, 1/2 of
``max_model_len`` = 256, 97 blocks of 8 in every arm); every request is a 16-token prompt and a
240-token output (outputs much longer than every window). A coarse grid of rates with short
points (``duration_s`` of arrivals each), so that the whole study runs in minutes on a CPU:
capacities are grid rates, not bisected. Variant ``smoke``: a small random model, two rates.
"""

import ml_collections

from experiments.configs import sliding_window


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    if arg not in ("default", "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    c = sliding_window.get_config(arg)
    del c["warmup"]  # every point's engine is warmed up (experiments.serving.build_engine)
    c.rates = (1.0, 2.0, 4.0, 8.0)  # req/s; each point offers rate * duration_s requests
    c.duration_s = 8.0
    c.ttft_slo_ms = 2000.0  # p99
    c.tpot_slo_ms = 100.0  # p99
    c.max_drain_s = 30.0  # wall limit per point: the last arrival + this (then aborted)
    c.stop_after_failures = 1  # an arm stops at its first miss (capacity is fixed by it)
    if arg == "smoke":
        c.window_fractions = (0.25,)
        c.rates = (8.0, 16.0)  # two requests per point (at least two, `rate * duration_s`),
        c.duration_s = 0.125  # arriving within ~0.25 s: the points do not wait on the clock
        c.ttft_slo_ms = 10000.0
        c.tpot_slo_ms = 2000.0
        c.max_drain_s = 20.0
        c.stop_after_failures = 2
    return c
