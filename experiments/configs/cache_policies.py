"""Config of `experiments/cache_policies.py`: prefix-cache eviction policies against Belady's
optimum on the Mooncake traces (simulated).

Launch::

    python -m experiments.cache_policies
    python -m experiments.cache_policies --config=experiments/configs/cache_policies.py:smoke
    python -m experiments.cache_policies --config.traces="('conversation',)" \
        --config.pool_fractions="(0.25,)"

One simulated H200 (``paged.sim.RooflineStepModel``) serving Llama-3-8B dimensions, blocks of
512 tokens (the traces' block size, so an engine block is a trace block), the real scheduler and
block manager with ``prefix_eviction`` set per arm. The device pool holds ``fraction`` x the
window's distinct prompt blocks (plus nothing else: running requests share it). Each trace is
read in ``windows[trace]`` (seconds; ``()``: the whole trace) at its own arrival times.
Variants: ``default``, ``window``, ``hour`` (the whole traces, pools of 1/8, 1/4, 1/2; run in
pieces: one trace, pool fraction and factor slice per command) (two minutes of conversation, one of synthetic, the goal's pool
size only), ``smoke`` (what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "Llama-3-8B"
    c.traces = ("conversation", "synthetic")
    c.windows = ml_collections.ConfigDict({"conversation": (0.0, 600.0),
                                           "synthetic": (0.0, 300.0)})
    c.pool_fractions = (0.25, 0.5)  # device pool blocks / distinct prompt blocks of the window
    c.policies = ("lru", "lfu", "slru", "cost", "waiting", "tail_first", "priority")
    c.schedulers = ("decode-first",)  # EngineConfig.policy: FCFS admission; "lpm", "dfs-weight"
    c.host_fractions = (0.0,)  # host tier blocks / device pool blocks (0: no host tier)
    c.rate_scales = (1.0,)  # the trace's arrivals at scale x its rate; > 1 scale: capacity
    c.ttft_slo_ms = 30000.0  # capacity: p99 TTFT within this at every scale up to it
    c.max_time_factor = 4.0  # a run must end by max_time_factor * span + 60 s (simulated)
    c.plots = True
    c.output_dir = ""
    c.engine = engine_config_dict(block_size=512, max_model_len=196608, max_num_seqs=256,
                                  max_num_batched_tokens=8192, dtype="bfloat16",
                                  async_scheduling=False)
    if arg == "window":  # what fits the 20 s a run may take without the shared lock
        c.windows.conversation = (0.0, 120.0)
        c.windows.synthetic = (0.0, 60.0)
        c.pool_fractions = (0.25,)
        c.engine.max_num_seqs = 32  # running sequences hold a small share of the small pool
    elif arg == "hour":  # the whole of both traces; pieces: one pool fraction per command
        c.windows.conversation = ()
        c.windows.synthetic = ()
        c.pool_fractions = (0.125, 0.25, 0.5)
        c.max_time_factor = 3.0
    elif arg == "smoke":
        c.traces = ("conversation",)
        c.windows.conversation = (0.0, 8.0)
        c.windows.synthetic = (0.0, 4.0)
        c.pool_fractions = (0.25,)
        c.policies = ("lru", "lfu")
        c.plots = False
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, window, hour, smoke")
    return c
