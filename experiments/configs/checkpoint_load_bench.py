"""Config of `experiments/checkpoint_load_bench.py`: checkpoint load time against a plain read.

Launch::

    python -m experiments.checkpoint_load_bench                   # ~1 GB bf16 checkpoint
    python -m experiments.checkpoint_load_bench --config=experiments/configs/checkpoint_load_bench.py:smoke

Variants: ``default`` (a synthetic Llama of about ``target_bytes`` = 1 GiB in bfloat16, four
shards, three rounds), ``smoke`` (about 8 MiB, one round; what the tests run).
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.target_bytes = 2**30  # size of the synthetic checkpoint's tensors (bf16)
    c.d_model = 2048
    c.ffn_dim = 8192
    c.num_heads = 16
    c.num_kv_heads = 4
    c.vocab_size = 32000
    c.num_shards = 4
    c.rounds = 3  # each round: plain read and load_checkpoint, cold then warm page cache
    c.load_dtypes = ("bfloat16", "float32")  # dtypes load_checkpoint converts to
    c.tmp_dir = ""  # where the checkpoint is written ("" = a new temp dir, removed at the end)
    c.min_free_factor = 3.0  # refuse unless the disk has this many times target_bytes free
    c.seed = 0
    c.output_dir = ""  # default results/checkpoint_load_bench/<UTC timestamp>/
    if arg == "smoke":
        c.target_bytes = 8 * 2**20
        c.d_model = 256
        c.ffn_dim = 512
        c.num_heads = 4
        c.num_kv_heads = 2
        c.vocab_size = 1000
        c.num_shards = 2
        c.rounds = 1
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
