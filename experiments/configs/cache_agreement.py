"""Config of `experiments/cache_agreement.py`: the CPU engine and the simulator on the same
time-scaled window of a Mooncake trace; do their prefix-cache hit rates agree?

Launch::

    python -m experiments.cache_agreement
    python -m experiments.cache_agreement --config=experiments/configs/cache_agreement.py:smoke

The window's prompts are shrunk for the CPU engine (``block`` tokens per trace block,
``paged.workload.mooncake_trace.load_mooncake_trace(block=...)``; an engine block is a trace
block, so the hits are the trace's), its arrivals compressed by ``time_scale``; the engine runs
``random-small`` (random weights: hits do not depend on them). The pool holds ``pool_fraction``
x the window's distinct prompt blocks (plus one sequence's worth). Variants: ``default`` (the
first 120 s of the conversation trace), ``smoke`` (20 s; what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict

# The CPU engine that serves a trace window (also the router_events study's replicas).
WINDOW_ENGINE = dict(block_size=16, max_model_len=4096, max_num_seqs=16,
                     max_num_batched_tokens=512, min_token_bucket=512, min_seq_bucket=16,
                     async_scheduling=False)


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "random-small"
    c.trace = "conversation"
    c.window = (0.0, 120.0)
    c.block = 16  # tokens per trace block (the trace's 512 scaled down), = engine.block_size
    c.time_scale = 0.1  # arrival times x this (0.1: ten times the trace's rate)
    c.pool_fraction = 0.25
    c.policies = ("lru", "arc")
    c.output_dir = ""
    c.engine = engine_config_dict(**WINDOW_ENGINE)
    if arg == "smoke":
        c.window = (0.0, 20.0)
        c.policies = ("lru",)
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
