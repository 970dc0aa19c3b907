"""Config of `experiments/kernel_bench.py`: paged decode and ragged attention, per implementation.

Launch (from the repo root)::

    .venv/bin/python -m experiments.kernel_bench --config=experiments/configs/kernel_bench.py:cpu
    .venv/bin/python -m experiments.kernel_bench --config=experiments/configs/kernel_bench.py:smoke
    python -m experiments.kernel_bench --config=experiments/configs/kernel_bench.py:h200 --peak_gbps=4800

Variants:
  ``cpu``   the CPU target shape (B=32, context 1024, Hq=32, Hkv=8, D=128, float32): "xla" paged vs
            dense contiguous, interleaved; writes results/kernel_bench/<UTC timestamp>/ unless
            ``--out`` names a file (the committed figures of 2026-12-01, archived for want of a label: experiments/results/archive/kernel_bench_cpu.json).
  ``smoke`` tiny shapes, every implementation including the interpret-mode kernels and JAX's own
            Pallas kernels; a test runs it end to end (timings meaningless).
  ``h200``  one H200: bfloat16, longer contexts, compiled GPU-style Pallas vs "xla" vs JAX's GPU
            kernel; correctness first; sized for < 3 minutes including compiles (what
            ``experiments/device_check.sh`` gives it). Ran on an H200 on 2026-11-30:
            experiments/results/archive/h200/README.md (archived: the JSONs name a stale commit).

Correctness: every implementation is compared with an oracle computed on the device: the plain
float32 reference (``impl="reference"``, under ``jax.default_matmul_precision("highest")`` so no
TF32) while its materialised gather stays under ``reference_bytes_limit``, else (or if it fails,
e.g. out of memory) the "xla" path. The oracle itself is checked against float64 numpy on
``oracle_check_seqs`` whole sequences spread over the batch (first and last included; only their
pages are converted), so the check costs seconds on the host even for the h200 shapes, where a
float64 numpy pass over every sequence would convert GBs of pool. h200: the decode reference
gathers 2 GiB (float32) and the ragged one 16 GiB, both under its 32 GiB limit on a 141 GB device.

Copy baseline: each op also times ``k + z, v + z`` over the whole K/V pool (``z`` a runtime zero) in
the same interleaved rounds; ``copy.gbps`` counts read + write, and each implementation's
``fraction_of_copy`` is its achieved GB/s over that (the GPU target: >= 0.8). On CPU that copy is
XLA's elementwise loop, not a memcpy, so fractions above 1 occur there.

Timing: ``repeats`` rounds, each timing every run once, forward and backward order alternating;
ratios are taken per round and the headline ``ratio_to_dense`` is their median over rounds (min,
max and IQR beside it in ``ratio_to_dense_rounds``). ``cpu`` has a target, "paged xla decode <=
1.25x dense contiguous decode" (``target_*``), judged on that median; the JSON's ``target`` records
the claim, the statistic, the ratio and its spread. The dense baseline of an op is one contiguous
call per distinct query length (the ragged step's prefill chunk, decodes and verifications each
with their own query rows), so it does the same work as the paged call.

Implementation names are those of `pallas_kernels.api` (a ``@unmasked`` suffix picks the GPU-style
kernels' null-page gather fallback) plus ``jax_gpu`` / ``jax_tpu`` (JAX's own
Pallas paged-attention kernels, run in interpret mode off their backend: ``jax_gpu_interpret``,
``jax_tpu_interpret``). The dense baseline of each implementation is `pallas_kernels.flash_attention`
with the same ``impl`` on a contiguous copy of the same data (JAX kernels use the "xla" baseline).
Override any field, e.g. ``--config.decode.batch=8 --config.repeats=5``.
"""

import ml_collections


def _heads(hq, hkv, d):
    return ml_collections.ConfigDict(dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d))


def _decode(batch, context):
    return ml_collections.ConfigDict(dict(batch=batch, context=context))


def _ragged(num_decodes, decode_context, num_prefills, prefill_chunk, prefill_context, verify):
    """A mixed step: decodes, prefill chunks (the last ``prefill_chunk`` of ``prefill_context``
    tokens) and ``verify`` sequences checking 4 draft tokens at ``decode_context``."""
    return ml_collections.ConfigDict(
        dict(
            num_decodes=num_decodes, decode_context=decode_context, num_prefills=num_prefills,
            prefill_chunk=prefill_chunk, prefill_context=prefill_context, num_verify=verify,
        )
    )  # fmt: skip


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = arg
    c.seed = 0
    c.dtype = "float32"
    c.page_size = 16
    c.extra_pages = 64  # spare pages in the pool (NaN-filled, never read)
    c.repeats = 15  # interleaved timing rounds; medians (and per-round ratios' spread) reported
    c.quick_repeats = 5  # timings taken right after each check (kept if the run is cut short)
    c.calls_per_round = 1  # back-to-back calls per timing, blocking on the last (see h200)
    c.warmup = 2
    c.peak_gbps = 20.0  # roughly one DDR channel pair; override per machine (--peak_gbps)
    c.datasheet_gbps = 0.0  # the memory's datasheet figure for frac_of_datasheet (0: peak_gbps)
    c.rtol = 2e-4  # correctness check (float32 accumulate; looser for bf16 below)
    c.atol = 2e-4
    c.out = ""  # "" = results/kernel_bench/<UTC timestamp>/kernel_bench.json (git-ignored)
    c.ops = ("decode", "ragged")  # in this order; e.g. --config.ops="('ragged',)"
    c.reference_bytes_limit = 2 << 30  # above: the "xla" path is the oracle (see docstring)
    c.oracle_check_seqs = 4  # sequences whose oracle output float64 numpy checks (0: none)
    c.heads = _heads(32, 8, 128)
    c.decode = _decode(32, 1024)
    c.ragged = _ragged(32, 1024, 1, 64, 512, 2)
    # Tuples, not lists: config_flags overrides tuples, e.g. --config.decode_impls="('xla',)".
    c.decode_impls = ("xla",)
    c.ragged_impls = ("xla",)
    # KV dtype as a factor: each op (decode, ragged) also runs on the same data with K/V quantized
    # to each of these formats (record key "decode@int8", ...; "auto", the model dtype, is the op
    # itself), bytes counted at the quantized size (values + float32 scales); no dense baseline
    # there. kv_impls: the implementations run on quantized pools (() = the op's, minus jax_*).
    c.kv_cache_dtypes = ()
    c.kv_scale_granularity = "page"
    c.kv_impls = ()
    c.dense_head_major = True  # "xla" family: also time dense on [B, Hkv, T, D] K/V
    # Speed target, judged on ratio_to_dense: the median over rounds of per-round paged/dense
    # ratios (0: the variant has none).
    c.target_op = "decode"
    c.target_impl = "xla"
    c.target_max_ratio = 0.0
    c.xla_block_tokens = 128  # XlaConfig knobs (CPU-tuned defaults)
    c.xla_items_per_group = 4
    c.tpu_pages_per_compute_block = 8
    c.gpu_pages_per_compute_block = 4
    c.gpu_k_splits = 8
    c.gpu_queries_per_block = 16
    # op "decode_grid": decode at every (dtype, context, batch), data made on the device, each
    # point's kernel splits from the heuristic (pallas_kernels.gpu_tuning.decode_splits), checked
    # (float64, first and last sequence) then timed against compare_to on the same arrays.
    c.decode_grid = ml_collections.ConfigDict(dict(
        dtypes=("float32",), contexts=(64,), batches=(1, 3), impls=("xla",), compare_to="xla",
        repeats=3, min_timing_ms=2.0, use_heuristic=True,
    ))  # fmt: skip
    if arg == "cpu":
        # The machine is shared: per-round paged/dense ratios spread widely under other load
        # (IQR ~0.35 seen with 4 other agents busy), so many rounds for a stable median (~2 min).
        c.repeats = 101
        c.target_max_ratio = 1.25  # paged xla decode <= 1.25x dense contiguous decode
        c.note = "shared 2-core CPU (5 agents): absolute times are noisy, read the ratios"
    elif arg == "smoke":
        c.repeats = 1
        c.warmup = 0  # the correctness call already compiled everything
        c.quick_repeats = 1
        c.extra_pages = 2
        c.heads = _heads(4, 2, 64)
        c.decode = _decode(3, 40)
        c.ragged = _ragged(2, 40, 1, 8, 24, 1)
        c.decode_impls = (
            "xla", "reference", "interpret_tpu", "interpret_gpu", "jax_gpu_interpret",
            "jax_tpu_interpret",
        )  # fmt: skip
        c.ragged_impls = ("xla", "reference", "interpret_tpu", "interpret_gpu")
        c.page_size = 8
        c.gpu_k_splits = 2
        c.tpu_pages_per_compute_block = 2
        c.gpu_pages_per_compute_block = 2
        c.out = ""  # the test passes its own temporary path
        c.ops = ("decode", "ragged", "decode_grid")
        c.decode_grid.contexts = (40,)  # one point: the path, not the numbers
        c.decode_grid.batches = (3,)
        c.decode_grid.use_heuristic = False  # 2 splits (the heuristic gives 1 at this size)
        c.decode_grid.impls = ("interpret_gpu", "jax_gpu_interpret", "xla")
        c.decode_grid.compare_to = "jax_gpu_interpret"
        c.decode_grid.repeats = 1
        c.decode_grid.min_timing_ms = 0.0
        c.target_max_ratio = 1.25  # only exercises the target record; meaningless here
        c.kv_cache_dtypes = ("int8", "fp8_e4m3")
        c.kv_impls = ("xla", "interpret_tpu", "interpret_gpu")
        c.note = "smoke: exercises every path on tiny shapes; timings are meaningless"
    elif arg == "h200":
        c.dtype = "bfloat16"
        c.rtol = c.atol = 2e-2
        c.peak_gbps = 4800.0  # H200 HBM3e; the JSON also gives each kernel's fraction of copy
        c.datasheet_gbps = 4800.0  # H200 HBM3e datasheet bandwidth (frac_of_datasheet)
        c.ops = ("decode", "ragged", "decode_grid")  # device_check.sh runs each in its own stage
        c.reference_bytes_limit = 32 << 30  # the reference oracle for both ops on the device
        c.repeats = 20
        # A decode step reads ~1 GB: ~0.25 ms at 4.3 TB/s, where one call's dispatch + sync
        # (~20-50 us) would be 10-20 %; 10 queued calls per timing leave the device's own time.
        c.calls_per_round = 10
        c.heads = _heads(32, 8, 128)
        c.decode = _decode(64, 4096)
        c.ragged = _ragged(128, 2048, 2, 256, 2048, 8)
        # "@unmasked": the null-page gather fallback, in case the masked gather does not lower.
        # Checked (and quick-timed) in this order: the kernel, the one to beat, the fallback.
        # "@heuristic": the same kernel with the dispatcher's split / block choice (2 x 8 here)
        # beside the config's explicit 4 x 8.
        c.decode_impls = ("pallas_gpu", "jax_gpu", "pallas_gpu@heuristic", "pallas_gpu@unmasked",
                          "xla")  # fmt: skip
        c.ragged_impls = ("pallas_gpu", "pallas_gpu@unmasked", "xla")
        c.gpu_pages_per_compute_block = 8
        c.gpu_k_splits = 4  # H200, B=64 ctx 4096: 84% of copy bandwidth (8: 81%, 16: 77%)
        c.xla_block_tokens = 512  # fewer, wider loop steps on a GPU
        c.xla_items_per_group = 64
        # Decode grid (its own device_check stage): 2 dtypes x 3 contexts x 4 batches = 24 points,
        # pallas_gpu (heuristic splits) vs JAX's kernel (given the same splits). Estimate on an
        # H200: ~2 s of Triton compiles per kernel per point (~4 s), data generation and the
        # read / copy programs ~0.5 s, timing 5 rounds x (4 runs of >= 2 ms) ~0.1-0.5 s (the
        # largest, fp32 B=256 ctx 16k, 17 GB of K/V, ~5 ms a call): ~100 s for all 24 points.
        # Points run cheapest first within each dtype, bf16 before fp32, and the JSON is
        # rewritten after each, so a cut-off run keeps the bf16 half.
        c.decode_grid = ml_collections.ConfigDict(dict(
            dtypes=("bfloat16", "float32"), contexts=(1024, 4096, 16384), batches=(1, 8, 64, 256),
            impls=("pallas_gpu", "jax_gpu"), compare_to="jax_gpu", repeats=5, min_timing_ms=2.0,
            use_heuristic=True,
        ))  # fmt: skip
        c.note = "one H200; results of 2026-11-30 in experiments/results/archive/h200/"
    else:
        raise ValueError(f"unknown variant {arg!r}; known: cpu, smoke, h200")
    return c
