"""Config of `experiments/sliding_window.py`: full attention vs sliding windows, same pool bytes.

Launch::

    python -m experiments.sliding_window                                   # default (tiny model)
    python -m experiments.sliding_window --config=experiments/configs/sliding_window.py:smoke
    python -m experiments.sliding_window --config.output_dir=/tmp/sw

Every arm serves the same long-output requests offline (all arrive at t = 0) on an engine with the
same ``num_blocks`` (same pool bytes: the windows change no block's size). The arms are the model
with full attention and the same weights with every layer sliding at a window of
``fraction * max_model_len`` tokens, one arm per entry of ``window_fractions`` (the window must be
at least ``block_size``). Variants: ``default`` (the bundled tiny model's trained weights, which
were trained with full attention: the windowed arms write different text, the memory and the
schedule are what is measured), ``smoke`` (a small random model, a handful of short requests;
what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"  # bundled weights (served with each arm's window); "random-small" for tests
    c.window_fractions = (0.125, 0.25, 0.5)  # sliding arms: W = fraction * max_model_len

    # Every engine setting (`engine_fields`), with this study's defaults; the same for every arm.
    c.engine = engine_config_dict(
        block_size=8,
        # 96 usable blocks: 3 sequences at full length with full attention (32 blocks each);
        # a window arm holds ceil(W / 8) + 2 blocks per sequence at most (+ 1: async stepping).
        num_blocks=97,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        max_model_len=256,
        attention_impl="xla",
        enable_prefix_caching=False,  # distinct prompts; keeps freed blocks out of the cache
        min_seq_bucket=8,
        min_token_bucket=64,
    )

    w = c.workload = ml_collections.ConfigDict()
    w.num_requests = 24
    w.prompt_len = 16  # own prompt tokens, BOS included
    w.output_len = 240  # long outputs: prompt + output = max_model_len
    w.seed = 0
    c.warmup = True  # compile every step shape before the timed run (throughput excludes it)
    c.plots = True
    c.output_dir = ""  # default results/sliding_window/<UTC timestamp>/
    if arg == "smoke":
        c.model = "random-small"
        c.engine.block_size = 4
        c.engine.num_blocks = 21  # 20 usable: 6 x 3 fit, 6 x 6 do not
        c.engine.max_num_seqs = 8
        c.engine.max_num_batched_tokens = 16
        c.engine.max_model_len = 32
        c.engine.min_seq_bucket = 8
        c.engine.min_token_bucket = 16
        c.workload.num_requests = 6
        c.workload.prompt_len = 4
        c.workload.output_len = 20
        c.warmup = False
        c.plots = False
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
