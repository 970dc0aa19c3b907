"""Config of `experiments/fleet.py`: what-if capacity studies on a modelled H200, in simulation.

Launch::

    python -m experiments.fleet
    python -m experiments.fleet --config=experiments/configs/fleet.py:smoke
    python -m experiments.fleet --config.studies="('replicas',)" --config.models="('Qwen2.5-7B',)"

Every result is ``evidence: simulated``: the real scheduler and block manager drive a roofline
step-time model (``paged.sim.RooflineStepModel``) of one H200 per replica serving a model of the
given dimensions (no weights). Capacity = the highest request rate whose run finishes every
request within ``max_time_factor`` times its arrival span with p99 TTFT and p99 TPOT within the SLO,
found by bracketing then ``bisect_steps`` bisections of the rate.

Studies (``studies``): ``block_size``, ``batched_tokens`` (``max_num_batched_tokens``),
``preemption`` (recompute vs swap), each at ``tight_kv_gb`` of KV memory so memory binds;
``replicas`` (replica counts x router policies) on a multi-tenant shared-prefix workload at
``kv_gb`` per replica; ``speed`` (simulator wall and CPU time against the number of requests at the
largest replica count; with ``speed_compare_stepping`` the smallest size is also run one step per
host pass, and its records must equal fast-forward's); ``point`` (one what-if, not among the
defaults: p50 / p99 TTFT and TPOT, throughput and prefix hits of ``point_replicas`` replicas behind
``point_router`` at ``point_rate`` req/s), for example::

    python -m experiments.fleet --config.studies="('point',)" --config.models="('Llama-3-8B',)" \\
        --config.point_rate=500 --config.point_replicas=64 --config.point_router=prefix_aware \\
        --config.engine.block_size=16

``traces`` (not among the defaults; ``experiments/fleet_traces.py``): capacity on the Azure LLM
inference traces 2023 (``evidence: simulated`` over ``real``): per trace, per setup
(``trace_setups``: a model on T H200s in tensor parallel) and per arm (``trace_arms``), the
highest time-scaled rate meeting ``trace_ttft_slo_ms`` / ``trace_tpot_slo_ms`` at p99, with
goodput-against-rate plots. Variants ``traces`` (both traces, whole hour, Llama-3-8B x1 and
Llama-3-70B x8) and ``traces_smoke`` (a tenth of a 2-minute window, one setup, three arms;
what the test runs)::

    python -m experiments.fleet --config=experiments/configs/fleet.py:traces
    python -m experiments.fleet --config=experiments/configs/fleet.py:traces \
        --config.trace_window="(1200, 2400)" --config.trace_system_prompt_len=512

KV what-ifs (``experiments/fleet_whatifs.py``; each arm's pool from the same KV bytes,
``whatif_kv_gb`` or one H200's HBM after the weights): variants ``kv_dtype`` (Llama-3-8B per
``kv_dtypes``, constructed and the Azure traces), ``window`` (``window_model`` Mistral-7B with its
4,096-token window against full attention), ``window_fractions`` (Mistral-7B dimensions with
windows of 1/8, 1/4, 1/2 of ``window_max_model_len`` against full attention, on long outputs),
``cascade`` (``cascade_modes`` on shared system
prompts), each with a ``_smoke`` form::

    python -m experiments.fleet --config=experiments/configs/fleet.py:kv_dtype \
        --config.trace_window="(1200.0, 1800.0)"
    python -m experiments.fleet --config=experiments/configs/fleet.py:window
    python -m experiments.fleet --config=experiments/configs/fleet.py:window_fractions
    python -m experiments.fleet --config=experiments/configs/fleet.py:cascade
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.models = ("Llama-3-8B", "Qwen2.5-7B")
    c.bandwidth = "copy"  # "copy": measured 3.1 TB/s; "datasheet": 4.8 TB/s
    c.studies = ("block_size", "batched_tokens", "preemption", "replicas", "speed")  # or "point"
    c.ttft_slo_ms = 1000.0
    c.tpot_slo_ms = 50.0
    c.kind = "sharegpt"
    c.duration_s = 30.0  # offered load per point: rate * duration_s requests (capped)
    c.max_requests = 100_000
    c.replica_duration_s = 5.0  # offered load per point in the replicas study
    c.replica_models = ("Llama-3-8B",)  # of ``models``, those the replicas and speed studies run
    c.max_time_factor = 2.0  # a point must finish by max_time_factor * duration_s + 30 s
    c.rate_lo = 4.0  # per replica, first bracket
    c.rate_hi = 64.0
    c.bisect_steps = 3
    c.replica_bisect_steps = 2
    c.kv_gb = 20.0  # KV memory per replica in the replicas study
    c.tight_kv_gb = 6.0  # KV memory in the block-size, batched-token and preemption studies
    c.block_sizes = (8, 16, 32, 64, 128)
    c.batched_tokens = (512, 1024, 2048, 4096, 8192)
    c.replicas = (1, 4, 16, 64)
    c.routers = ("round_robin", "least_loaded", "prefix_aware")
    c.load_threshold = 16
    c.num_prefixes = 512  # tenants / conversations, each with its own shared prefix
    c.prefix_len = 768
    c.speed_requests = (1000, 10_000, 100_000)
    c.speed_compare_stepping = True  # also step the smallest size one step per pass (same records)
    c.speed_rate_per_replica = 8.0
    # ``point``: one what-if, e.g. 64 replicas at 500 req/s behind the prefix-aware router (not in
    # the default ``studies``; block size and the rest from ``engine``, KV memory ``kv_gb``).
    c.point_rate = 500.0  # req/s over the whole fleet
    c.point_replicas = 64
    c.point_router = "prefix_aware"
    c.point_workload = "tenants"  # "tenants" (the replicas study's shared prefixes) or "plain"
    # ``traces``: capacity on the real Azure traces (experiments/fleet_traces.py).
    c.trace_services = ("code", "conv")
    c.trace_setups = (("Llama-3-8B", 1), ("Llama-3-70B", 8))  # (model, H200s in tensor parallel)
    c.trace_arms = (
        ("paged+prefix cache", {}),
        ("paged, no prefix cache", {"enable_prefix_caching": False}),
        ("contiguous+static", {"kv_layout": "contiguous", "scheduling": "static"}),
        ("paged+prefix, block 8", {"block_size": 8}),
        ("paged+prefix, block 32", {"block_size": 32}),
    )  # engine overrides; block 16 is the engine default (the first two arms)
    c.trace_window = ()  # () = whole trace; (start_s, end_s): a window (recorded in the label)
    c.trace_subsample = 1.0  # fraction of requests kept (seeded by ``seed``; 1 = all)
    c.trace_max_model_len = 8192  # Llama 3 context; longer requests shrink (clip_lengths)
    c.trace_ttft_slo_ms = 2000.0  # p99
    c.trace_tpot_slo_ms = 100.0  # p99
    c.trace_speedup_lo = 1.0  # first bracket, in multiples of the trace's own mean rate
    c.trace_speedup_hi = 8.0
    c.trace_bisect_steps = 4
    c.trace_hbm_gb = 141.0  # H200 memory per device
    c.trace_memory_utilization = 0.9  # KV = this x T x hbm - weights
    c.trace_prompt_seed = 0  # synthetic prompt ids (the traces have counts only)
    c.trace_system_prompt_len = 0  # > 0: ASSUME every request shares a system prompt this long
    # KV what-ifs (experiments/fleet_whatifs.py; not among the defaults): each arm's pool holds
    # what ``whatif_kv_gb`` GB (0: one H200's HBM after the weights, as the traces) affords.
    c.whatif_kv_gb = 0.0
    c.kv_dtypes = ("auto", "fp8_e4m3", "int8")  # ``kv_dtype``: one arm per KV cache dtype
    c.window_model = "Mistral-7B"  # ``window``: its sliding window against full attention
    c.window_max_model_len = 16384  # ShareGPT-like lengths scale with it (many pass the window)
    c.window_duration_s = 120.0  # offered load per point (long outputs need a longer run)
    c.window_fractions = ()  # () = the model's own window; else windows f * window_max_model_len
    c.window_prompt_len = 1024  # with window_output_len > 0: long-output fixed-length requests
    c.window_output_len = 0  # 0 = ShareGPT-like lengths (``kind``) scaled to window_max_model_len
    c.cascade_modes = ("off", "auto", "on")  # ``cascade``: one arm per cascade_attention
    c.cascade_num_prefixes = 4  # tenants sharing a long system prompt each
    c.cascade_prefix_len = 1024
    c.plots = True
    c.seed = 0
    c.output_dir = ""
    c.engine = engine_config_dict(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048,
                                  dtype="bfloat16", async_scheduling=False)
    if arg == "smoke":
        c.models = ("Llama-3-8B",)
        c.duration_s = 2.0
        c.max_requests = 400
        c.replica_duration_s = 2.0
        c.rate_lo = 4.0
        c.rate_hi = 32.0
        c.bisect_steps = 1
        c.block_sizes = (16, 64)
        c.batched_tokens = (512, 2048)
        c.replicas = (1, 4)
        c.num_prefixes = 8
        c.prefix_len = 256
        c.speed_requests = (100, 300)
        c.engine.max_model_len = 1024
        c.engine.max_num_seqs = 64
    elif arg in ("traces", "traces_smoke"):
        c.studies = ("traces",)
        c.engine.max_model_len = 8192
        if arg == "traces_smoke":
            c.trace_window = (180.0, 300.0)
            c.trace_subsample = 0.1
            c.trace_setups = (("Llama-3-8B", 1),)
            c.trace_arms = c.trace_arms[:3]
            c.trace_max_model_len = 4096
            c.trace_bisect_steps = 1
    elif arg in ("kv_dtype", "kv_dtype_smoke"):
        c.studies = ("kv_dtype", "traces")
        c.models = ("Llama-3-8B",)
        c.trace_setups = (("Llama-3-8B", 1),)
        c.trace_arms = tuple((f"kv_cache_dtype={d}", {"kv_cache_dtype": d}) for d in c.kv_dtypes)
        if arg == "kv_dtype_smoke":
            c.studies = ("kv_dtype", "traces")
            c.duration_s, c.max_requests, c.bisect_steps = 2.0, 120, 0
            c.trace_services = ("conv",)
            c.trace_window = (180.0, 240.0)
            c.trace_subsample = 0.1
            c.trace_max_model_len = 2048
            c.trace_bisect_steps = 0
            c.plots = False
    elif arg in ("window", "window_smoke"):
        c.studies = ("window",)
        # Outputs of up to ~16k tokens at ~20 ms each outlast 2 x the arrival span: let every
        # request finish (capacity is then the SLO's, not the time limit's).
        c.max_time_factor = 5.0
        if arg == "window_smoke":
            c.window_max_model_len = 8192
            c.window_duration_s = 4.0
            c.max_requests = 12
            c.bisect_steps = 0
            c.rate_lo, c.rate_hi = 1.0, 2.0
    elif arg in ("window_fractions", "window_fractions_smoke"):
        # Full attention against windows of 1/8, 1/4, 1/2 of max_model_len on long outputs
        # (every request a 1,024-token prompt and a 7,168-token output: 8,192 tokens each).
        c.studies = ("window",)
        c.window_fractions = (0.125, 0.25, 0.5)
        c.window_max_model_len = 8192
        c.window_prompt_len, c.window_output_len = 1024, 7168
        # A 7,168-token output at ~30 ms per token lives ~215 s: offer load for longer than
        # that, so that a point reaches a steady state rather than a burst the pool absorbs.
        c.window_duration_s = 360.0
        c.max_time_factor = 2.5
        c.rate_lo, c.rate_hi = 0.5, 2.0
        if arg == "window_fractions_smoke":
            c.window_max_model_len = 1024
            c.window_prompt_len, c.window_output_len = 64, 896
            c.window_duration_s = 4.0
            c.max_requests = 8
            c.bisect_steps = 0
            c.rate_lo, c.rate_hi = 1.0, 2.0
            c.plots = False
    elif arg in ("cascade", "cascade_smoke"):
        c.studies = ("cascade",)
        c.models = ("Llama-3-8B",)
        if arg == "cascade_smoke":
            c.duration_s, c.max_requests, c.bisect_steps = 2.0, 60, 0
            c.cascade_prefix_len = 256
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke, traces, traces_smoke, "
                         "kv_dtype, kv_dtype_smoke, window, window_smoke, window_fractions, "
                         "window_fractions_smoke, cascade, cascade_smoke")
    return c
