"""Config of `experiments/sparse_decode.py`: Quest page selection against dense paged decode.

Launch (from the repo root)::

    .venv/bin/python -m experiments.sparse_decode --config.output_dir=experiments/results/sparse_decode
    .venv/bin/python -m experiments.sparse_decode --config=experiments/configs/sparse_decode.py:smoke
    .venv/bin/python -m experiments.sparse_decode --config=experiments/configs/sparse_decode.py:retrieval

Variants: ``default`` (bytes read per decode step and CPU-XLA attention time at 1k-8k contexts
for budgets 1/4, 1/8, 1/16 of the pages; Hq=9, Hkv=3, D=64 as SmolLM2-135M, page 16, float32,
4 sequences; minutes on 2 CPU cores), ``smoke`` (tiny shapes, 2 rounds: what the test runs;
timings meaningless), ``retrieval`` (no kernel points: needle retrieval of SmolLM2-135M through
the engine at 2k / 4k for ``arms``: dense, the three budgets with the first two layers dense
(Quest), 1/8 selecting in every layer), ``quality`` (teacher-forced perplexity, KL and top-1
agreement vs dense at 1k / 2k, the three budgets with and without the two dense layers),
``answers`` (teacher-forced needle answers at 4k, 5 depths x 4 needles, dense and 1/8 with
each ``gqa``), ``h200`` (compiled GPU-style Pallas, bfloat16, Hq=32, Hkv=8, D=128, 32k, the selection through
the decode and the ragged kernel: the ``sparse_decode`` stage of ``experiments/device_check.sh``).
Override any field, e.g. ``--config.contexts=4096``.
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.impl = "xla"
    c.contexts = (1024, 2048, 4096, 8192)  # tokens per sequence (one decode step each)
    c.fractions = (0.25, 0.125, 0.0625)  # budgets: fraction of each sequence's pages
    c.batch = 4
    c.num_q_heads = 9
    c.num_kv_heads = 3
    c.head_dim = 64
    c.page_size = 16
    c.dtype = "float32"
    c.sparse_ops = ("paged",)  # kernels fed the selected pages: "paged" (decode), "ragged"
    c.repeats = 9  # interleaved rounds per point
    c.warmup = 2
    c.calls = 3
    c.seed = 0
    # Retrieval on the real model (empty: skipped).
    c.model = "smollm2-135m"
    c.retrieval_lengths = ()
    c.arms = ("dense", "0.25:2", "0.125:2", "0.0625:2", "0.125:0")  # "dense" or "F:L" (fraction
    # F of the pages, the first L layers dense; Quest's default L = 2)
    c.fidelity_lengths = ()  # teacher-forced perplexity / KL vs dense (empty: skipped)
    c.fidelity_chunks = 4
    c.answer_lengths = ()  # teacher-forced needle answers, every arm per prompt (empty: skipped)
    c.retrieval_depths = (0.1, 0.5, 0.9)
    c.needles_per_cell = 2
    c.block_size = 16
    c.max_num_batched_tokens = 512
    c.output_dir = ""  # default results/sparse_decode/<UTC timestamp>/
    if arg == "smoke":
        c.contexts = (256, 512)
        c.fractions = (0.25,)
        c.batch = 2
        c.num_q_heads, c.num_kv_heads, c.head_dim = 4, 2, 16
        c.repeats, c.warmup, c.calls = 2, 1, 1
        c.sparse_ops = ("paged", "ragged")
    elif arg == "retrieval":
        c.contexts = ()
        c.retrieval_lengths = (2048, 4096)
    elif arg == "quality":
        c.contexts = ()
        c.fidelity_lengths = (1024, 2048)
        c.arms = ("dense", "0.25:2", "0.125:2", "0.0625:2", "0.25:0", "0.125:0", "0.0625:0")
    elif arg == "answers":
        c.contexts = ()
        c.answer_lengths = (4096,)
        c.retrieval_depths = (0.1, 0.3, 0.5, 0.7, 0.9)
        c.needles_per_cell = 4
        c.arms = ("dense", "0.125:2", "0.125:2:rank", "0.125:2:union", "0.0625:2:union")
    elif arg == "h200":
        c.impl = "pallas_gpu"
        c.dtype = "bfloat16"
        c.contexts = (4096, 32768)
        c.fractions = (0.125,)
        c.batch = 8
        c.num_q_heads, c.num_kv_heads, c.head_dim = 32, 8, 128
        c.repeats, c.calls = 5, 10
        c.sparse_ops = ("paged", "ragged")
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke, retrieval, quality, "
                         "answers, h200")
    return c
