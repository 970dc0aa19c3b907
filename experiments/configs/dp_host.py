"""Config of `experiments/dp_host.py`: host time per step of D data-parallel replicas, in one
process (``Engine``) and one process per replica (``paged.server.replica_process``), device
call stubbed out.

Launch::

    python -m experiments.dp_host --config=experiments/configs/dp_host.py
    python -m experiments.dp_host --config=experiments/configs/dp_host.py:smoke

Variants: ``default`` (the bundled tiny model, 64 decoding sequences per replica, D = 2 and 4),
``smoke`` (a small random model, 4 sequences per replica, D = 2, few steps; what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    if arg not in ("default", "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    c = ml_collections.ConfigDict()
    c.model = "tiny"  # bundled weights; "random-small" = a small random model
    c.replicas = (2, 4)  # D of each data-parallel arm (each in process and in processes)
    c.num_running = 64  # decoding sequences per replica
    c.prompt_len = 16
    c.warmup_steps = 3  # steps after every prompt is in, before timing
    c.steps = 16  # timed steps per block
    c.rounds = 8  # blocks per arm; each round rotates which arm goes first
    c.engine = engine_config_dict(block_size=16, max_model_len=512, attention_impl="xla",
                                  max_num_seqs=None, max_num_batched_tokens=None)
    c.output_dir = ""  # default results/dp_host/<UTC timestamp>/
    if arg == "smoke":
        c.model = "random-small"
        c.replicas = (2,)
        c.num_running = 4
        c.engine.max_model_len = 64
        c.engine.block_size = 8
        c.warmup_steps = 1
        c.steps = 3
        c.rounds = 2
    return c
