"""Config of `experiments/fragmentation.py`: position fragmentation of a fixed reservation vs paging.

Launch::

    python -m experiments.fragmentation                  # the seed table (what `make run` prints)
    python -m experiments.fragmentation --config=experiments/configs/fragmentation.py:smoke
    python -m experiments.fragmentation --config.block_sizes="(8,16,32,64,128)" --config.max_len=512
    python -m experiments.fragmentation --config.model_config=experiments/model_configs/llama-3-8b/config.json

Variants: ``default`` (the source document's five lengths, 16- and 32-token pages, a 512-position
reservation), ``smoke`` (three short lengths; what the CLI tests run).
"""

import ml_collections

SEED_LENGTHS = (37, 91, 128, 201, 511)


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.lengths = SEED_LENGTHS  # tokens per sequence (>= 0, each <= max_len)
    c.block_sizes = (16, 32)  # tokens per page (>= 1)
    c.max_len = 512  # positions a fixed reservation holds per sequence
    # A Hugging Face config.json (e.g. experiments/model_configs/llama-3-8b/config.json): also
    # report each layout's KV bytes for that model (dtype: the config's, else model_dtype).
    c.model_config = ""
    c.model_dtype = ""  # KV dtype override for model_config ("" = the config's dtype)
    c.output_dir = ""  # default results/fragmentation/<UTC timestamp>/ (fragmentation.json)
    if arg == "smoke":
        c.lengths = (5, 17, 40)
        c.block_sizes = (4, 16)
        c.max_len = 64
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
