"""Config of `experiments/host_tier_fleet.py`: how much host memory for a Llama-3-8B H200 replica?

Launch::

    python -m experiments.host_tier_fleet
    python -m experiments.host_tier_fleet --config=experiments/configs/host_tier_fleet.py:smoke
    python -m experiments.host_tier_fleet --config.links="('pcie5',)" \
        --config.host_multipliers="(0, 4)"

Every result is ``evidence: simulated``: one simulated H200 (``paged.sim.RooflineStepModel``)
serving Llama-3-8B dimensions with the KV pool one H200 holds after the weights; the real
scheduler, block manager and host-tier bookkeeping; the host tier at ``multiplier *`` the device
pool's bytes (0: off), its loads and offloads priced on each link of ``links``
(``paged.sim.host_link``: ``pcie5`` = PCIe Gen5 x16, ``c2c`` = GH200's NVLink-C2C). Workloads:
constructed multi-tenant multi-turn conversations whose distinct prefix tokens are
``prefix_over_pool`` times the device pool, and (``azure``) a window of the Azure conversation
trace with an ASSUMED shared system prompt. Variants: ``default``, ``smoke`` (what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "Llama-3-8B"
    c.bandwidth = "copy"  # H200 HBM: "copy" (measured 3.1 TB/s) or "datasheet" (4.8 TB/s)
    c.links = ("pcie5", "c2c")
    c.host_multipliers = (0, 1, 2, 4, 8, 16)  # host tier bytes / device pool bytes
    c.device_kv_gb = 0.0  # 0: one H200's HBM at memory_utilization after the bf16 weights
    c.hbm_gb = 141.0
    c.memory_utilization = 0.9
    c.ttft_slo_ms = 1000.0  # p99
    c.tpot_slo_ms = 50.0  # p99
    c.max_time_factor = 2.0  # a point must finish by max_time_factor * span + 30 s
    c.rate_lo = 8.0  # req/s, first bracket of the capacity search (fleet.capacity)
    c.rate_hi = 16.0
    c.bisect_steps = 1

    w = c.workload = ml_collections.ConfigDict()
    w.num_tenants = 8  # each its own system prompt
    w.system_prompt_len = 1024
    w.turns = 4
    w.user_len = 512  # user tokens added per turn
    w.reply_len = 512  # the previous reply's tokens in the next turn's history
    w.output_len = 128  # tokens generated per turn
    w.prefix_over_pool = 4.0  # conversations: distinct prefix tokens / device pool tokens
    w.seed = 0

    a = c.azure = ml_collections.ConfigDict()
    a.enabled = True
    a.window = (1200.0, 1500.0)  # seconds of the conversation trace
    a.system_prompt_len = 1024  # ASSUMED: every request starts with one shared system prompt
    a.max_model_len = 8192
    a.speedup = 2.0  # arrivals time-scaled to this multiple of the window's own rate
    a.prompt_seed = 0

    c.plots = True
    c.seed = 0
    c.output_dir = ""
    c.engine = engine_config_dict(max_model_len=8192, max_num_seqs=256,
                                  max_num_batched_tokens=2048, dtype="bfloat16",
                                  async_scheduling=False)
    if arg == "smoke":
        c.links = ("pcie5",)
        c.host_multipliers = (0, 4)
        c.device_kv_gb = 0.05  # ~380 Llama-3-8B tokens: the pool binds at once
        c.rate_lo, c.rate_hi, c.bisect_steps = 8.0, 16.0, 0
        c.workload.num_tenants = 2
        c.workload.system_prompt_len = 32
        c.workload.turns = 3
        c.workload.user_len = 16
        c.workload.reply_len = 16
        c.workload.output_len = 4
        c.workload.prefix_over_pool = 3.0
        c.azure.window = (1200.0, 1210.0)
        c.azure.system_prompt_len = 32
        c.azure.max_model_len = 256
        c.engine.max_model_len = 256
        c.engine.max_num_seqs = 16
        c.engine.max_num_batched_tokens = 256
        c.plots = False
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
