"""Config of `experiments/block_size_sweep.py`: what the KV block size B costs and buys.

Launch::

    python -m experiments.block_size_sweep                                   # default (tiny model)
    python -m experiments.block_size_sweep --config=experiments/configs/block_size_sweep.py:smoke
    python -m experiments.block_size_sweep --config.timed_block_sizes=8,16,32 \
        --config.output_dir=/tmp/sweep

Every block size gets the same KV pool in positions (so the same bytes: ``pool_positions``), the
same constructed ShareGPT-like workload (lengths scaled to ``max_model_len``) and the same SLO.
Position metrics for every B come from the workload's lengths (formulas) and, for the timed block
sizes, from the engine's ledger; the timed part (one engine per B, all compiled first; then
``repeats`` rounds over the block sizes in alternating order, each a short real-time serving run and
decode steps with the pool full) runs for ``timed_block_sizes`` (empty = all of ``block_sizes``).
Variants: ``default``, ``smoke`` (a small random model, a handful of requests; what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"  # bundled weights; "random-small" = small random model (tests)
    c.block_sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    c.timed_block_sizes = ()  # () = every block size gets an engine; else a subset of block_sizes
    c.pool_positions = 2048  # KV pool per B (null page excluded): num_blocks = ceil(this / B) + 1

    # Every engine setting (`engine_fields`); block_size and num_blocks are set per swept size.
    c.engine = engine_config_dict(
        max_num_seqs=32,
        max_num_batched_tokens=64,
        max_model_len=512,
        attention_impl="xla",  # any page size; Pallas impls may restrict page sizes
        enable_prefix_caching=False,  # BOS-only sharing at B=1 would blur the fragmentation numbers
        min_seq_bucket=32,  # one sequence bucket and two token buckets: two compilations per B
        min_token_bucket=32,
        block_size=None,  # set per swept size (block_sizes)
        num_blocks=None,  # ceil(pool_positions / B) + 1 per swept size
    )

    w = c.workload = ml_collections.ConfigDict()
    w.kind = "sharegpt"  # constructed lognormal lengths, scaled to max_model_len
    w.num_requests = 40
    w.rate = 12.0  # requests/s, Poisson: below B=16 capacity, above what B=256 fits in the pool
    w.burstiness = 1.0
    w.seed = 0
    w.trace = ""  # a JSONL trace instead of a constructed workload
    w.evidence = ""  # the trace's label if its file has no header: real / constructed / simulated

    c.ttft_slo_ms = 1000.0
    c.tpot_slo_ms = 100.0
    c.max_wall_s = 60.0  # per serving run; requests still in flight are aborted (and reported)
    c.repeats = 2  # rounds over the timed block sizes, order alternating; serving: mean of rounds
    c.decode_warmup_steps = 2  # decode steps after every prompt is in, before timing
    c.decode_steps = 40  # timed decode steps with the pool full, per round
    c.output_dir = ""  # default results/block_size_sweep/<UTC timestamp>/
    c.plots = True
    if arg == "smoke":
        c.model = "random-small"
        c.block_sizes = (4, 8, 16, 32)
        c.timed_block_sizes = (8, 32)
        c.pool_positions = 256
        c.engine.max_num_seqs = 8
        c.engine.max_num_batched_tokens = 32
        c.engine.max_model_len = 64
        c.engine.min_seq_bucket = 8
        c.workload.num_requests = 6
        c.workload.rate = 20.0
        c.max_wall_s = 30.0
        c.decode_warmup_steps = 1
        c.decode_steps = 3
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
