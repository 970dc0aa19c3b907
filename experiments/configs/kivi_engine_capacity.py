"""Config of `experiments/kivi_engine_capacity.py`: tokens the engine holds at equal KV bytes,
int4 / int2 KIVI pages against the model dtype (bfloat16) and int8, measured from the engine.

Launch::

    python -m experiments.kivi_engine_capacity
    python -m experiments.kivi_engine_capacity --config=experiments/configs/kivi_engine_capacity.py:smoke
    python -m experiments.kivi_engine_capacity --config.page_sizes="(16,)"

Variants: ``default`` (pages of 64 and 16, 1024-token sequences, a budget of 4 bfloat16
sequences), ``smoke`` (page 16, 64-token sequences).
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # The KV shape per layer (D = 128 as the arithmetic); one layer and one KV head:
    # every format's bytes scale with L * Hkv alike, so the ratios do not depend on them.
    c.num_layers = 1
    c.num_kv_heads = 1
    c.head_dim = 128
    c.dtype = "bfloat16"  # the model dtype (the open page's and the baseline's)
    c.formats = ("auto", "int8", "int4", "int2")
    c.page_sizes = (64, 16)
    c.seq_len = 1024  # tokens of each sequence when it finishes (prompt + generated)
    c.generated = 64  # of which generated (outlasts the admission of every prompt)
    c.budget_seqs = 4  # the KV budget: this many bfloat16 sequences of seq_len (+ the null page)
    c.max_num_batched_tokens = 512
    c.seed = 0
    c.output_dir = ""  # default results/kivi_engine_capacity/<UTC timestamp>/
    if arg == "smoke":
        c.page_sizes = (16,)
        c.seq_len = 64
        c.generated = 32
        c.max_num_batched_tokens = 64
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
