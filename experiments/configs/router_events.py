"""Config of `experiments/router_events.py`: the router's prefix-aware routing on the replicas'
KV events (ZeroMQ) against the same routing asking the replicas' caches directly.

Launch::

    python -m experiments.router_events
    python -m experiments.router_events --config=experiments/configs/router_events.py:smoke

``num_replicas`` CPU engines (``random-small``: hits do not depend on the weights) serve a window
of a Mooncake trace with prompts shrunk to ``block`` tokens per trace block
(`paged.workload.mooncake_trace`), arrivals compressed by ``time_scale``; each replica's pool
holds ``pool_fraction`` x the window's distinct prompt blocks. Variants: ``default`` (the first
120 s of the conversation trace, 4 replicas), ``smoke`` (20 s, 2 replicas; what the test runs).
"""

import ml_collections

from experiments.configs.cache_agreement import WINDOW_ENGINE
from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "random-small"
    c.trace = "conversation"
    c.window = (0.0, 120.0)
    c.block = 16  # tokens per trace block, = engine.block_size
    c.time_scale = 0.1
    c.pool_fraction = 0.25  # per replica, of the window's distinct prompt blocks
    c.num_replicas = 4
    c.load_threshold = 4  # paged.fleet.routing.Router's prefix_aware load bound
    c.arms = ("direct", "events", "least_loaded")
    c.output_dir = ""
    c.engine = engine_config_dict(**WINDOW_ENGINE)
    if arg == "smoke":
        c.window = (0.0, 20.0)
        c.num_replicas = 2
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
