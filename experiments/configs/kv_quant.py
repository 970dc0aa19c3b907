"""Config of `experiments/kv_quant.py`: the quality cost of a quantized KV cache.

Launch::

    python -m experiments.kv_quant
    python -m experiments.kv_quant --config=experiments/configs/kv_quant.py:smoke
    python -m experiments.kv_quant --config.models=tiny --config.max_tokens=64

Variants: ``default`` (the bundled tiny model and every committed Hugging Face fixture under
``tests/fixtures/hf``, 128 generated tokens), ``smoke`` (the tiny model, two formats, 8 tokens:
what the test runs), ``smollm2`` (SmolLM2-135M-Instruct from its GGUF file, 32 generated
tokens: under 10 minutes on 2 CPU cores), ``smollm2_smoke`` (one format, 4 tokens).
"""

import ml_collections

FIXTURES = tuple(f"tests/fixtures/hf/{name}" for name in
                 ("llama", "llama3_bf16", "mistral", "qwen2"))


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.models = ("tiny",) + FIXTURES
    # (kv_cache_dtype, kv_scale_granularity) arms, each against the unquantized model.
    c.formats = ("int8:token", "int8:page", "fp8_e4m3:token", "fp8_e4m3:page", "fp8_e5m2:token",
                 "fp8_e5m2:page")
    c.page_size = 16  # the block size whose "page" scales are reproduced
    c.max_tokens = 128  # greedy tokens generated per prompt
    c.num_prompts = 4
    c.seed = 0
    c.output_dir = ""  # default results/kv_quant/<UTC timestamp>/
    if arg == "smoke":
        c.models = ("tiny",)
        c.formats = ("int8:token", "fp8_e5m2:page")
        c.max_tokens = 8
        c.num_prompts = 2
    elif arg in ("smollm2", "smollm2_smoke"):
        c.models = ("smollm2-135m",)
        c.max_tokens = 32  # 30 layers without a cache: 128 tokens would take about 4x longer
        if arg == "smollm2_smoke":
            c.formats = ("int8:token",)
            c.max_tokens = 4
            c.num_prompts = 1
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke, smollm2, "
                         "smollm2_smoke")
    return c
