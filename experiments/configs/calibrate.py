"""Config of `experiments/calibrate.py`: measure the engine's step times, fit a step-time model.

Launch::

    python -m experiments.calibrate
    python -m experiments.calibrate --config=experiments/configs/calibrate.py:smoke
    python -m experiments.calibrate --config=experiments/configs/calibrate.py:serving
    python -m experiments.calibrate --config.decode_batch_sizes="(1,8,32)"

Grid: decode steps at every (batch size, context length) pair, and pure prefill steps of each
chunk size (one request per step, prefix caching off so every token is computed). Each point is
``steps`` measured steps (decode) or ``repeats`` steps (prefill); the fit takes one row per
point (its mean shape, its median time) unless ``aggregate='none'``.
Variant ``serving``: instead of the grid, the step periods of real-time serving runs of
``serving_workloads`` (their own seed), one fit over every step. Writes ``calibration.json`` (``output_dir``; the committed copy is
``experiments/results/archive/sim/calibration_cpu.json``, archived).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"
    c.decode_batch_sizes = (1, 4, 16, 32)
    c.context_lens = (16, 128, 384)
    c.prefill_chunks = (16, 64, 128, 256)
    c.steps = 16  # measured decode steps per point
    c.repeats = 8  # measured prefill steps per chunk size
    c.warmup_steps = 2  # decode steps run before measuring each point
    c.warmup = "grid"  # "grid": one unmeasured pass compiles the grid's shapes; "all": every shape
    c.features = ("const", "tokens", "seqs", "kv_read")  # the fitted form (paged.sim.linear_model)
    c.alt_features = (("const", "padded_tokens", "seqs", "kv_read"),
                      ("const", "tokens", "seqs", "kv_read", "attn_pairs"))  # reported beside
    c.aggregate = "median"  # fit one row per grid point (median time), or "none": every step
    c.mode = "grid"  # "grid": the grid below; "serving": step periods of real-time serving runs
    c.serving_workloads = (("sharegpt", 0, 8.0), ("sharegpt", 0, 48.0), ("alpaca", 0, 96.0),
                           ("sharegpt", 64, 24.0))
    c.serving_duration_s = 6.0  # per serving workload (rate * duration requests)
    c.serving_weights = "absolute"  # serving mode: least squares on periods (the mean period)
    # Serving mode's form. ``prefill_seqs`` prices a step's prefill chunks apart from its decodes:
    # without it, least squares over mostly decode steps prices the steps with a chunk ~14 % low
    # and simulated p50 TTFT comes out ~10 % low (experiments/results/sim/README.md).
    c.serving_features = ("const", "tokens", "seqs", "prefill_seqs", "kv_read", "after_idle")
    c.keep_points = 600  # points written to calibration.json (the fit uses every one)
    c.seed = 0
    c.output_dir = ""
    c.engine = engine_config_dict(max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256,
                                  async_scheduling=False, enable_prefix_caching=False)
    if arg == "smoke":
        c.model = "random-small"
        c.decode_batch_sizes = (1, 4)
        c.context_lens = (16, 64)
        c.prefill_chunks = (16, 64)
        c.steps = 3
        c.repeats = 2
        c.warmup_steps = 1
        c.engine.max_model_len = 128
        c.engine.max_num_seqs = 4
        c.engine.max_num_batched_tokens = 64
    elif arg == "serving":
        c.mode = "serving"
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, serving, smoke")
    return c
