"""Config of `experiments/engine_bench.py`: decode steps/s and host overhead per engine step.

Launch::

    python -m experiments.engine_bench --config=experiments/configs/engine_bench.py
    python -m experiments.engine_bench --config=experiments/configs/engine_bench.py:smoke
    python -m experiments.engine_bench --config=experiments/configs/engine_bench.py:gpu \
        --config.output_dir=$OUT/engine_bench     # (experiments/device_check.sh)
    python -m experiments.engine_bench --config.engine.policy=prefill-first   # any engine field

Variants: ``default`` (64 and 256 running sequences, the bundled tiny model), ``smoke`` (a small
random model, few steps; what the test runs), ``gpu`` (the default on a GPU, run by
``experiments/device_check.sh``: 256 running first, so a run stopped by the device time limit still
has the figure the host-overhead target is read at; attention by the backend's default kernels;
the same steps and rounds, whose isolated blocks stub out the device call as on CPU). Nothing here picks the device: JAX's default backend
(the GPU when present) runs the step.
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"  # bundled weights; "random-small" = a small random model (no files needed)
    c.num_running = (64, 256)  # running sequences in the decode phase
    c.prompt_len = 16
    # Every engine setting (`engine_fields`); each run sets max_num_seqs (its running sequences)
    # and max_num_batched_tokens (one token per sequence, at least 256, + churn_chunk in churn).
    c.engine = engine_config_dict(
        block_size=16,
        max_model_len=512,
        attention_impl="xla",
        enable_prefix_caching=True,  # the engine's default: full blocks are keyed as they fill
        max_num_seqs=None,
        max_num_batched_tokens=None,
    )
    c.warmup_steps = 3  # decode steps after all prompts are in, before timing
    c.steps = 32  # timed steps per block; each round: overlap on, off, device stubbed (3 blocks)
    c.rounds = 4  # even: the on/off order alternates (A B, B A)
    c.churn_running = (256,)  # the churn regime (see engine_bench.py); () to skip
    c.churn_prompt_len = (8, 64)  # uniform [low, high) prompt lengths, BOS included
    c.churn_max_tokens = (16, 256)  # uniform [low, high) output lengths
    c.churn_chunk = 256  # token budget for prefill chunks on top of one token per sequence
    c.churn_warmup_steps = 150  # steps before timing, so lengths are mixed
    c.output_dir = ""  # default results/engine_bench/<UTC timestamp>/ (writes engine_bench.json)
    if arg == "smoke":
        c.model = "random-small"
        c.num_running = (4,)
        c.engine.max_model_len = 64
        c.engine.block_size = 8
        c.warmup_steps = 1
        c.steps = 3
        c.rounds = 2
        c.churn_running = (4,)
        c.churn_prompt_len = (4, 12)
        c.churn_max_tokens = (2, 8)
        c.churn_chunk = 16
        c.churn_warmup_steps = 4
    elif arg == "gpu":
        c.num_running = (256, 64)
        c.engine.attention_impl = "auto"  # the GPU-style Pallas kernels
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke, gpu")
    return c
