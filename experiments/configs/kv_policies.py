"""Config of `experiments/kv_policies.py`: KV eviction policies (method x budget) on a real
pretrained model (SmolLM2-135M-Instruct, GGUF): retrieval, agreement with full KV, and the KV
bytes a sequence really holds (the ledger).

Launch::

    python -m experiments.kv_policies
    python -m experiments.kv_policies --config=experiments/configs/kv_policies.py:smoke

Arms: "full" (the reference) or "<method>:<budget>" with a method of
``paged.config.kv_policy.METHODS`` and a budget as ``KVPolicyConfig.budget`` (a fraction
``0.25`` or a token count ``256``). The policy runs once, when the prompt's prefill ends
(kvpress's setting: compress the context, then answer). Variants: ``default`` (1k and 2k
retrieval at three depths, budgets 10 / 25 / 50 % and 128 / 256 tokens), ``smoke`` (1k, one
depth, two needles, 25 / 50 %).
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "smollm2-135m"
    c.arms = ("full", *(f"{m}:{b}" for m in ("streaming_llm", "knorm")
                        for b in ("0.1", "0.25", "0.5", "128", "256")))
    c.needle_lengths = (1024, 2048)
    c.needle_depths = (0.1, 0.5, 0.9)
    c.needles_per_cell = 2
    c.sink_tokens = 4
    c.block_size = 16
    c.max_num_batched_tokens = 512
    c.max_tokens = 24
    c.seed = 0
    c.output_dir = ""  # default results/kv_policies/<UTC timestamp>/
    if arg == "smoke":
        c.arms = ("full", "streaming_llm:0.25", "streaming_llm:0.5", "knorm:0.25", "knorm:0.5")
        c.needle_lengths = (1024,)
        c.needle_depths = (0.5,)
        c.needles_per_cell = 2
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
