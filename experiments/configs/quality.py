"""Config of `experiments/quality.py`: what each KV mechanism costs in model quality on a real
pretrained model (SmolLM2-135M-Instruct, GGUF).

Launch::

    python -m experiments.quality
    python -m experiments.quality --config=experiments/configs/quality.py:smoke
    python -m experiments.quality --config=experiments/configs/quality.py:long
    python -m experiments.quality --config=experiments/configs/quality.py:long_smoke
    python -m experiments.quality --config.arms="('float32', 'int8:token')" --config.num_chunks=2

Variants: ``default`` (every arm, perplexity over 512- and 2048-token chunks, retrieval at 1k /
2k / 4k tokens at three depths), ``long`` (adds 8192-token chunks and 8k retrieval; not run:
it is longer than the default's 49 minutes on 2 CPU cores), ``long_smoke`` (the 8k cells alone: float32 and int8:token, one 8192-token chunk,
one 8k needle at depth 0.5), ``smoke``
(three arms, 256-token chunks, 1k retrieval at one depth, two exact checks: what the test
runs), ``exact`` (the exact checks only).

Arms: "float32" (the reference), "bfloat16" (weights, activations and KV in bfloat16),
"<int8|fp8_e4m3|fp8_e5m2>:<token|page>" (quantized pages, `EngineConfig.kv_cache_dtype` with
its scale granularity), "<int4|int2>:kivi" (KIVI pages of ``block_size`` tokens, from the no-cache
forward: `experiments/quality_dense.py`; variant ``kivi``: short, 512-token chunks and three 1k
needles, since the dense greedy decode re-runs the whole sequence per token), "<int4|int2>:engine"
(the same pages served by the engine; variant ``kivi_engine``: against bfloat16 and int8:token,
512-token chunks, one 1k needle; ``kivi_engine_smoke``: one 128-token chunk), "window:<W>" (a sliding window of W tokens on every layer of this
full-attention model). Exact mechanisms (``exact_checks``, `experiments/quality_exact.py`) must
change nothing: a check each, not a figure; ``arms=()`` runs only the checks (the ``exact``
variant).
"""

import ml_collections

ARMS = ("float32", "bfloat16", "int8:token", "int8:page", "fp8_e4m3:token", "fp8_e4m3:page",
        "fp8_e5m2:token", "fp8_e5m2:page", "window:256", "window:1024")
EXACT = ("prefix_caching", "cascade", "host_tier", "preemption_recompute", "preemption_swap",
         "speculation_ngram", "speculation_draft")


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "smollm2-135m"
    c.arms = ARMS
    c.chunk_lengths = (512, 2048)  # perplexity chunks (tokens)
    c.num_chunks = 8  # chunks per length, consecutive from the corpus start
    c.fidelity_length = 512  # KL / top-1 over this many chunks of this length
    c.fidelity_chunks = 4
    c.needle_lengths = (1024, 2048, 4096)  # retrieval prompt lengths (tokens, approximate)
    c.needle_depths = (0.1, 0.5, 0.9)  # where the needle sits in the haystack
    c.needles_per_cell = 2  # different needles per (length, depth)
    c.exact_checks = EXACT
    c.block_size = 16
    c.max_num_batched_tokens = 512  # prefill chunk of the engine runs
    c.seed = 0
    c.output_dir = ""  # default results/quality/<UTC timestamp>/
    if arg == "smoke":
        c.arms = ("float32", "int8:token", "fp8_e5m2:page")
        c.chunk_lengths = (256,)
        c.num_chunks = 2
        c.fidelity_length = 256
        c.fidelity_chunks = 2
        c.needle_lengths = (1024,)
        c.needle_depths = (0.5,)
        c.needles_per_cell = 2
        c.exact_checks = ("prefix_caching", "preemption_swap")
    elif arg == "exact":
        c.arms = ()
    elif arg == "kivi":
        c.arms = ("float32", "bfloat16", "int4:kivi", "int2:kivi")
        c.chunk_lengths = (512,)
        c.num_chunks = 4
        c.needle_lengths = (1024,)
        c.needles_per_cell = 1
        c.exact_checks = ()
    elif arg in ("kivi_engine", "kivi_engine_smoke"):  # int4 / int2 served by the engine
        c.arms = ("float32", "bfloat16", "int8:token", "int4:engine", "int2:engine")
        c.chunk_lengths = (512,)
        c.num_chunks = 4
        c.needle_lengths = (1024,)
        c.needle_depths = (0.5,)
        c.needles_per_cell = 1
        c.exact_checks = ()
        if arg == "kivi_engine_smoke":
            c.arms = ("float32", "int4:engine")
            c.chunk_lengths = (128,)
            c.num_chunks = 1
            c.fidelity_length = 128
            c.fidelity_chunks = 1
    elif arg in ("long", "long_smoke"):
        c.chunk_lengths = (512, 2048, 8192)
        c.num_chunks = 4
        c.needle_lengths = (1024, 2048, 4096, 8000)
        if arg == "long_smoke":  # the 8k cells alone, two arms, one chunk / needle each
            c.arms = ("float32", "int8:token")
            c.chunk_lengths = (8192,)
            c.num_chunks = 1
            c.fidelity_chunks = 1
            c.needle_lengths = (8000,)
            c.needle_depths = (0.5,)
            c.needles_per_cell = 1
            c.exact_checks = ()
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke, exact, kivi, "
                         "long, long_smoke")
    return c
