"""Config of `experiments/serve.py` (the main job behind `make run`).

Launch::

    python -m experiments.serve                                   # default: the main job
    python -m experiments.serve --config=experiments/configs/serve.py:smoke
    python -m experiments.serve --config.workload.rate=4 --config.workload.num_requests=200
    python -m experiments.serve --config.engine.policy=prefill-first   # any EngineConfig field

The default serves one constructed ShareGPT-like workload (Poisson arrivals) twice, with the same
model, sampling and KV pool bytes: paged KV + continuous batching, and contiguous KV (every request
reserves max_model_len positions) + static request-level batching. Each arm then also serves
``real_arrivals``: 10 s of the real Azure conversation trace's arrivals (evidence real; lengths
scaled to max_model_len, prompt ids synthetic; every derivation in its label), one line per arm.
``--config.workload.azure=conv`` (or ``code``) serves a real trace as the main workload. Variants: ``default``,
``smoke`` (a small random model, a handful of requests; what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def engine_defaults() -> ml_collections.ConfigDict:
    """Every engine setting (`engine_fields`); the arms set ``kv_layout`` and ``scheduling``."""
    return engine_config_dict(
        block_size=16,
        num_blocks=129,  # 128 usable blocks of 16 = 2048 positions; contiguous: 8 buffers of 256
        max_num_seqs=32,
        max_num_batched_tokens=256,
        max_model_len=256,
        attention_impl="xla",
        enable_prefix_caching=True,
        preemption_mode="recompute",
        min_seq_bucket=32,  # one sequence bucket: few compilations, all done by warmup()
        min_token_bucket=32,
        kv_layout=None,  # set per arm (config.arms)
        scheduling=None,  # set per arm
    )


def workload_defaults() -> ml_collections.ConfigDict:
    w = ml_collections.ConfigDict()
    w.kind = "sharegpt"  # constructed lognormal lengths scaled to max_model_len
    w.num_requests = 120
    w.rate = 6.0  # requests/s (Poisson when burstiness == 1); 20 s of arrivals
    w.burstiness = 1.0
    w.seed = 0
    w.trace = ""  # a JSONL trace instead of a constructed workload
    # The trace's label when its file has no header line saying it: "real" (recorded traffic),
    # "constructed" (made by hand or by a script) or "simulated". "" = the header's label.
    w.evidence = ""
    # A real Azure trace instead ("code" / "conv"; evidence real; kind, num_requests, rate,
    # burstiness unused): its arrivals in ``window`` (seconds from its first request; () = all),
    # times ``time_scale``, lengths times ``length_scale`` then clipped to max_model_len, prompt
    # ids synthetic from ``seed``; each step recorded as a derivation in the label.
    w.azure = ""
    w.window = ()
    w.time_scale = 1.0
    w.length_scale = 0.125  # 256 / 2048: the constructed workloads' linear rule at max_model_len 256
    w.system_prompt_len = 0  # > 0: ASSUME one shared system prompt of this many tokens
    return w


def real_arrivals_defaults() -> ml_collections.ConfigDict:
    """The main job's second workload: a window of the real conversation trace (evidence real)."""
    w = workload_defaults()
    w.azure = "conv"
    w.window = (1200.0, 1210.0)  # 10 s from minute 20 of the trace: 55 requests
    w.time_scale = 1.0  # the real arrival times
    return w


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"  # bundled weights; "random-small" = small random model (tests)
    c.engine = engine_defaults()
    c.workload = workload_defaults()
    # Each arm also serves this real-arrival window (its own table lines and evidence label);
    # real_arrivals.azure = "" turns it off.
    c.real_arrivals = real_arrivals_defaults()
    c.arms = (
        ("paged+continuous", dict(kv_layout="paged", scheduling="continuous")),
        ("contiguous+static", dict(kv_layout="contiguous", scheduling="static")),
    )
    c.ttft_slo_ms = 2000.0
    c.tpot_slo_ms = 200.0
    c.max_wall_s = 120.0  # per arm; requests still in flight are aborted (and reported)
    c.output_dir = ""  # default results/serve/<UTC timestamp>/
    c.plots = True
    if arg == "smoke":
        c.model = "random-small"
        c.engine.num_blocks = 33
        c.engine.max_num_seqs = 4
        c.engine.max_num_batched_tokens = 32
        c.engine.max_model_len = 64
        c.engine.block_size = 8
        c.engine.min_seq_bucket = 4
        c.engine.min_token_bucket = 32
        c.workload.num_requests = 6
        c.workload.rate = 20.0
        c.real_arrivals.window = (1200.0, 1201.0)
        c.real_arrivals.length_scale = 1 / 32  # max_model_len 64 / 2048
        c.max_wall_s = 60.0
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
