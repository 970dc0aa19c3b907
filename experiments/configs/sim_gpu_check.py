"""Config of ``experiments/sim_gpu_check.py``: one real trace window served on this device and
simulated with the roofline step model on the same window.

Variants:
  ``default``  (a lent GPU, ``experiments/device_check.sh`` stage ``simval``): random weights of
               a ~1B-parameter Llama shape, bf16 KV, 60 s of the Azure conversation trace (minutes
               20-21, real arrival times, lengths clipped to 2048).
  ``smoke``    (the CPU dry run): the bundled tiny model, 5 s of the same trace, lengths x0.125.
"""

from __future__ import annotations

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"  # a bundled model or a checkpoint directory; ignored with random_model
    # Random weights of this LlamaConfig shape instead ({} = use ``model``): a model big enough
    # that the device, not the host, sets the step time, with no checkpoint to carry.
    c.random_model = ml_collections.ConfigDict(dict(
        d_model=2048, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128, ffn_dim=8192,
        vocab_size=32000))
    c.engine = engine_config_dict(
        block_size=16, num_blocks=8193, max_num_seqs=128, max_num_batched_tokens=2048,
        max_model_len=2048, attention_impl="auto", dtype="bfloat16", enable_prefix_caching=True,
        preemption_mode="recompute", min_seq_bucket=32, min_token_bucket=256)
    c.workload = ml_collections.ConfigDict(dict(
        azure="conv", window=(1200.0, 1260.0), time_scale=1.0, length_scale=1.0, seed=0,
        system_prompt_len=0))
    c.max_drain_s = 60.0  # after the last arrival, how long the real run may take to finish
    # The simulator's device: "H200" (paged.sim.specs.H200, exactly what the fleet studies
    # use) and the same figures with this device's copy bandwidth measured first ("measured").
    c.copy_bytes = 1 << 30  # array size of the copy that measures bandwidth (read + write)
    c.output_dir = ""
    if arg == "smoke":
        c.random_model = ml_collections.ConfigDict()
        c.engine.update(num_blocks=129, max_num_seqs=32, max_num_batched_tokens=256,
                        max_model_len=256, attention_impl="xla", dtype="float32",
                        min_token_bucket=32)
        c.workload.update(window=(1200.0, 1205.0), length_scale=0.125)
        c.max_drain_s = 20.0
        c.copy_bytes = 1 << 24
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
