"""Config of `experiments/cache_gap.py`: why online eviction policies fall short of Belady's
MIN on the Mooncake traces (an offline replay of the traces' block chains, no simulator).

Launch::

    python -m experiments.cache_gap
    python -m experiments.cache_gap --config=experiments/configs/cache_gap.py:smoke

``cases`` is a tuple of ``(trace, start_s, end_s)`` (``end_s`` <= 0: to the end of the trace);
each is replayed at ``pool_fractions`` x its distinct looked-up blocks with ``policies`` (the real
eviction orders, `paged.kv.blocks.eviction`). Variants: ``default`` (the first 10 minutes and the
whole hour of the conversation trace, the whole synthetic trace), ``smoke`` (one minute).
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.cases = (("conversation", 0.0, 600.0), ("conversation", 0.0, 0.0),
               ("synthetic", 0.0, 0.0))
    c.pool_fractions = (0.125, 0.25, 0.5)
    c.policies = ("lru", "lfu", "slru", "arc")
    c.output_dir = ""
    if arg == "smoke":
        c.cases = (("conversation", 0.0, 60.0),)
        c.pool_fractions = (0.25,)
        c.policies = ("lru", "arc")
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
