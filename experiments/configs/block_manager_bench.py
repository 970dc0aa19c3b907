"""Config of `experiments/block_manager_bench.py`: host cost of the block manager on a constructed trace.

Launch (from the repo root)::

    .venv/bin/python -m experiments.block_manager_bench --config=experiments/configs/block_manager_bench.py
    .venv/bin/python -m experiments.block_manager_bench --config=experiments/configs/block_manager_bench.py:smoke

Variants: ``default`` (10,000 requests, 256 running sequences, writes
``experiments/results/archive/block_manager_bench.json``, archived) and ``smoke`` (a few hundred short requests, writes
to a temp dir). Override any field, e.g. ``--config.max_running=128 --config.enable_prefix_caching=False``;
``--config.nanovllm_path=DIR`` adds nano-vllm's block manager on the same trace, interleaved.
"""

import tempfile

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    if arg not in ("default", "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: ['default', 'smoke']")
    c = ml_collections.ConfigDict()
    c.name = arg
    c.seed = 0
    # Trace: ShareGPT-like lognormal lengths (means as in the PagedAttention paper), clipped.
    c.num_requests = 10_000
    c.input_mean = 161.0
    c.output_mean = 338.0
    c.input_sigma = 1.0  # of the underlying normal
    c.output_sigma = 1.0
    c.min_input_len = 4
    c.max_input_len = 2048
    c.min_output_len = 1
    c.max_output_len = 2048
    c.vocab_size = 32_000
    c.shared_prefix_fraction = 0.3  # prompts that start with one of a few shared system prompts
    c.num_shared_prefixes = 16
    c.min_prefix_len = 32
    c.max_prefix_len = 256
    # Block manager and the replay loop.
    c.block_size = 16
    c.num_blocks = 20_000  # counts the null page
    c.max_running = 256
    c.enable_prefix_caching = True
    c.quarantine_steps = 1
    c.target_us_per_decode_step = 200.0
    # Microbenchmarks (per-operation cost in isolation).
    c.micro_repeats = 2000
    c.micro_runs = 3  # report the minimum over runs (the CPU is shared)
    c.spec_k = 4  # lookahead slots per speculative step
    # A local source snapshot of nano-vllm (a folder holding nanovllm/engine/block_manager.py,
    # nanovllm/engine/sequence.py, nanovllm/sampling_params.py, and xxhash importable): when set,
    # its BlockManager replays the same trace interleaved with ours. Empty: skipped.
    c.nanovllm_path = ""
    c.versus_apis = ("batch", "engine")  # our decode calls in the comparison (see _Ours)
    c.out = ""  # "" = results/block_manager_bench/<UTC timestamp>/ (git-ignored)
    if arg == "smoke":
        c.num_requests = 200
        c.output_mean = 24.0
        c.max_output_len = 64
        c.max_running = 16
        c.num_blocks = 2048
        c.micro_repeats = 50
        c.micro_runs = 1
        c.out = tempfile.gettempdir() + "/block_manager_bench_smoke.json"
    return c
