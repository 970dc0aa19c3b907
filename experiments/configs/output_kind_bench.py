"""Config of `experiments/output_kind_bench.py`: the host cost of per-step outputs.

Launch::

    python -m experiments.output_kind_bench --config.output_dir=experiments/results/output_kind_bench
    python -m experiments.output_kind_bench --config=experiments/configs/output_kind_bench.py:smoke

Two engines of the same settings, their device call stubbed out (`Engine.set_device_step`), hold
``num_running`` decoding requests each: one engine's requests ask for ``"cumulative"`` outputs,
the other's for ``"final_only"``. Their steps are timed alternately, block by block, so a ratio is
measured under one load. Variants: ``default``, ``smoke`` (tiny; what the test runs).
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"
    c.num_running = (64, 256)
    c.prompt_len = 16
    c.max_model_len = 512
    c.steps = 50  # timed steps per block
    c.rounds = 6  # blocks per engine, alternating (A B, then B A)
    c.output_dir = ""  # default results/output_kind_bench/<UTC timestamp>/
    if arg == "smoke":
        c.num_running = (4,)
        c.max_model_len = 64
        c.steps = 5
        c.rounds = 2
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
