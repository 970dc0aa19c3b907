"""Config of `experiments/kv_tiers.py`: the host KV tier off and at 1x / 4x / 16x the device pool.

Launch::

    python -m experiments.kv_tiers                                      # default (tiny model)
    python -m experiments.kv_tiers --config=experiments/configs/kv_tiers.py:smoke
    python -m experiments.kv_tiers --config.host_multipliers='(0, 4)'

Every arm serves the same constructed multi-tenant, multi-turn workload online (Poisson arrivals)
on an engine with the same device pool; only ``host_kv_cache_bytes`` changes: ``multiplier *``
the device pool's bytes (0: no tier). Variants: ``default`` (the bundled tiny model), ``smoke`` (a
small random model and a handful of requests; what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"
    c.host_multipliers = (0, 1, 4, 16)  # host tier bytes / device pool bytes; 0 = tier off

    c.engine = engine_config_dict(
        block_size=16,
        num_blocks=41,  # 40 usable: the workload's distinct prefix blocks are ~3.4x that
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=256,
        attention_impl="xla",
        min_token_bucket=128,  # one token bucket and one sequence bucket: one compiled shape
        min_seq_bucket=8,
        host_kv_cache_bytes=None,  # set per arm
    )

    w = c.workload = ml_collections.ConfigDict()
    w.num_tenants = 4  # each its own system prompt and cache salt
    w.conversations_per_tenant = 3
    w.turns = 5  # turn k's prompt: system prompt + k user chunks (the history grows)
    w.system_prompt_len = 64
    w.turn_len = 32  # user tokens added per turn
    w.output_len = 16
    w.rate = 4.0  # requests/s, Poisson
    w.seed = 0
    c.warmup = True
    c.plots = True
    c.output_dir = ""  # default results/kv_tiers/<UTC timestamp>/
    if arg == "smoke":
        c.model = "random-small"
        c.host_multipliers = (0, 4)
        c.engine.block_size = 4
        c.engine.num_blocks = 20
        c.engine.max_num_seqs = 4
        c.engine.max_num_batched_tokens = 32
        c.engine.max_model_len = 64
        c.engine.min_token_bucket = 32
        c.engine.min_seq_bucket = 4
        c.workload.num_tenants = 2
        c.workload.conversations_per_tenant = 2
        c.workload.turns = 3
        c.workload.system_prompt_len = 12
        c.workload.turn_len = 8
        c.workload.output_len = 4
        c.workload.rate = 1000.0
        c.warmup = False
        c.plots = False
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
