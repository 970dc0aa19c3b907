"""Config of `experiments/kivi_capacity.py`: tokens held at equal KV bytes, int4 / int2 KIVI pages
against bf16 and int8, from the exact accounting (`paged.accounting.ModelSpec`).

Launch::

    python -m experiments.kivi_capacity
    python -m experiments.kivi_capacity --config=experiments/configs/kivi_capacity.py:smoke
    python -m experiments.kivi_capacity --config.page_sizes="(16,32,64)" --config.seq_lens="(1000,)"

Variants: ``default`` (Llama-3-8B and Qwen2.5-7B shapes and SmolLM2-135M's, pages of 64 and 16,
sequences of 1000 and 1024 tokens, 16 GiB of KV), ``smoke`` (one model, one page size).
"""

import ml_collections

# name -> (layers, KV heads, head dim): the KV shapes (bfloat16 models)
MODELS = {"llama-3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128), "smollm2-135m": (30, 3, 64)}


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.models = ("llama-3-8b", "qwen2.5-7b", "smollm2-135m")  # keys of MODELS
    c.dtype = "bfloat16"  # the model dtype (and the open page's)
    c.formats = ("auto", "int8", "int4", "int2")  # "auto" = the model dtype; int8 with token scales
    c.page_sizes = (64, 16)
    c.seq_lens = (1024, 1000)  # tokens per running sequence
    c.budget_gib = 16.0  # KV bytes every format gets
    c.output_dir = ""  # default results/kivi_capacity/<UTC timestamp>/
    if arg == "smoke":
        c.models = ("smollm2-135m",)
        c.page_sizes = (16,)
        c.seq_lens = (100,)
        c.budget_gib = 0.25
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
