"""Config of `experiments/cascade.py`: cascade (shared-prefix) vs ordinary paged decode attention.

Launch (from the repo root)::

    .venv/bin/python -m experiments.cascade --config.output_dir=experiments/results/cascade
    .venv/bin/python -m experiments.cascade --config=experiments/configs/cascade.py:smoke

Variants: ``default`` (group sizes 1-16, shared prefixes of 64-1,024 tokens, a 16-token suffix
per member, Hq=8, Hkv=2, D=64, page 16, float32, on the "xla" path: a few minutes on 2 CPU
cores; the committed figures), ``smoke`` (two group sizes, two prefixes, 3 rounds: what the test
runs; timings meaningless), ``h200`` (compiled GPU-style Pallas, bfloat16, Hq=32, Hkv=8, D=128,
groups of 1-64 sharing 256-8,192 tokens with 64-token suffixes: the opt-in ``cascade`` stage of
``experiments/device_check.sh``; never run yet). Override any field, e.g. ``--config.group_sizes=2,8``.
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.impl = "xla"  # the implementation both sides use (cascade and ordinary paged attention)
    c.group_sizes = (1, 2, 4, 8, 16)  # members sharing the prefix (one group per step)
    c.prefix_tokens = (64, 128, 256, 512, 1024)  # shared prefix, whole pages
    c.suffix_tokens = 16  # each member's own tokens after the prefix
    c.num_q_heads = 8
    c.num_kv_heads = 2
    c.head_dim = 64
    c.page_size = 16
    c.dtype = "float32"
    c.repeats = 15  # interleaved rounds per point (cascade, ordinary, ordinary, cascade, ...)
    c.warmup = 2  # untimed calls per side after compiling
    c.calls = 3  # back-to-back calls per timing
    c.seed = 0
    c.output_dir = ""  # default results/cascade/<UTC timestamp>/
    c.plot = True
    if arg == "smoke":
        c.group_sizes = (1, 4)
        c.prefix_tokens = (32, 64)
        c.num_q_heads = 4
        c.head_dim = 16
        c.repeats = 3
        c.warmup = 1
        c.calls = 1
    elif arg == "h200":
        c.impl = "pallas_gpu"
        c.dtype = "bfloat16"
        c.group_sizes = (1, 2, 4, 8, 16, 64)
        c.prefix_tokens = (256, 1024, 4096, 8192)
        c.suffix_tokens = 64
        c.num_q_heads, c.num_kv_heads, c.head_dim = 32, 8, 128
        c.repeats = 10
        c.calls = 10  # hides the per-call dispatch latency behind the device's time
        c.plot = False
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke, h200")
    return c
