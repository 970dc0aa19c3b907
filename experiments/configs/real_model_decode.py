"""Config of `experiments/real_model_decode.py`: CPU decode throughput of a real model, paged KV
vs the contiguous-KV baseline, interleaved.

Launch::

    python -m experiments.real_model_decode
    python -m experiments.real_model_decode --config=experiments/configs/real_model_decode.py:smoke

Variants: ``default`` (SmolLM2-135M, batch 1 and 32, 5 interleaved rounds of 16 timed decode
steps each), ``smoke`` (batch 1 and 2, 1 round of 2 steps: what the test runs).
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "smollm2-135m"
    c.batch_sizes = (1, 32)
    c.layouts = ("paged", "contiguous")
    c.prompt_len = 32  # tokens of corpus text per request (distinct per request)
    c.warmup_steps = 4  # decode steps after the prefill, before timing (compiles the shape)
    c.steps = 16  # timed decode steps per round and arm
    c.rounds = 5  # rounds; each times every layout once, in turn
    c.max_model_len = 256
    c.block_size = 16
    c.output_dir = ""  # default results/real_model_decode/<UTC timestamp>/
    if arg == "smoke":
        c.batch_sizes = (1, 2)
        c.warmup_steps = 1
        c.steps = 2
        c.rounds = 1
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
