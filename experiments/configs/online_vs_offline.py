"""Config of `experiments/online_vs_offline.py` (the same workload in-process and over HTTP).

Launch::

    python -m experiments.online_vs_offline
    python -m experiments.online_vs_offline --config=experiments/configs/online_vs_offline.py:smoke
    python -m experiments.online_vs_offline --config.engine.max_num_seqs=32   # any EngineConfig field

The default runs 256 ShareGPT-like requests on an engine with ``max_num_seqs=64`` at two loads:
a burst (arrivals at 400/s, all in under a second, so 64 streams run concurrently from then on;
throughput is then the capacity of each path and ITL the per-token cost at 64 concurrent streams)
and 60 requests/s (below capacity: both paths should keep up with the offered load). Variants: ``default``,
``smoke`` (a small random model, a handful of requests; what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict
from experiments.configs.serve import workload_defaults


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"  # bundled weights; "random-small" = small random model (tests)
    c.engine = engine_config_dict(
        block_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        max_model_len=256,
        attention_impl="xla",
        min_seq_bucket=64,  # one sequence bucket: few compilations, all done by warmup
        min_token_bucket=64,
    )
    c.workload = workload_defaults()
    c.workload.num_requests = 256
    c.workload.rate = 400.0  # used when rates is empty
    # One load per rate: a burst (400/s: all 256 arrive in under a second, 64 streams run from
    # then on; throughput is capacity) and 60/s (below the in-process capacity on 2 CPU cores).
    c.rates = (400.0, 60.0)
    c.ttft_slo_ms = 2000.0
    c.tpot_slo_ms = 200.0
    c.max_wall_s = 300.0  # in-process arm's wall limit
    c.request_timeout_s = 600.0  # the HTTP client's per-request limit
    c.server_start_timeout_s = 300.0  # server start + warmup
    c.repeats = 3  # alternating offline / online runs, each with its own workload seed
    # The server's engine core in its own process (paged.server --engine_process true).
    c.engine_process = False
    c.per_request = False  # keep the per-request arrays (ttfts, itls, ...) in summary.json
    c.output_dir = ""  # default results/online_vs_offline/<UTC timestamp>/
    if arg == "smoke":
        c.model = "random-small"
        c.engine.max_num_seqs = 4
        c.engine.max_num_batched_tokens = 32
        c.engine.max_model_len = 64
        c.engine.block_size = 8
        c.engine.min_seq_bucket = 4
        c.engine.min_token_bucket = 32
        c.workload.num_requests = 6
        c.workload.rate = 20.0
        c.max_wall_s = 60.0
        c.request_timeout_s = 60.0
        c.server_start_timeout_s = 120.0
        c.repeats = 1
        c.rates = ()
        c.per_request = True
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
