"""Config of `experiments/disagg_engine.py`: colocated replicas against prefill/decode splits on
the CPU engine, a functional check (not a performance claim).

Launch::

    python -m experiments.disagg_engine                                   # default (tiny model)
    python -m experiments.disagg_engine --config=experiments/configs/disagg_engine.py:smoke

The study forces 4 host devices itself (``XLA_FLAGS=--xla_force_host_platform_device_count=4``)
when ``XLA_FLAGS`` is not set. Every arm serves the same constructed workload (Poisson arrivals,
Alpaca-like lengths) on ``data_parallel_size`` replicas with ``prefill_replicas`` = each value of
``splits`` (0 = colocated). Variants: ``default``, ``smoke`` (a small random model, a handful of
requests; what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"  # bundled weights; "random-small" = small random model (tests)
    # data_parallel_size and prefill_replicas are set per arm.
    c.engine = engine_config_dict(
        block_size=16, num_blocks=129, max_num_seqs=16, max_num_batched_tokens=256,
        max_model_len=512, attention_impl="xla", min_seq_bucket=16, min_token_bucket=64,
        data_parallel_size=None, prefill_replicas=None)
    c.data_parallel_size = 4
    c.splits = (0, 1, 2)  # prefill replicas per arm: colocated, P:D = 1:3, 2:2
    w = c.workload = ml_collections.ConfigDict()
    w.kind = "alpaca"
    w.num_requests = 64
    w.rate = 8.0  # requests/s, Poisson
    w.prompt_len = 0  # kind="fixed" only
    w.output_len = 0  # kind="fixed" only
    w.seed = 0
    c.ttft_slo_ms = 2000.0
    c.tpot_slo_ms = 200.0
    c.max_wall_s = 300.0
    c.output_dir = ""  # default results/disagg_engine/<UTC timestamp>/
    if arg == "smoke":
        c.model = "random-small"
        c.engine.block_size = 8
        c.engine.num_blocks = 33
        c.engine.max_num_seqs = 4
        c.engine.max_num_batched_tokens = 32
        c.engine.max_model_len = 64
        c.engine.min_seq_bucket = 4
        c.engine.min_token_bucket = 32
        c.splits = (0, 1)
        w.kind = "fixed"
        w.num_requests = 6
        w.rate = 50.0
        w.prompt_len = 12
        w.output_len = 4
        c.max_wall_s = 120.0
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
