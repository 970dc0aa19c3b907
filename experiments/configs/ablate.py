"""Config of `experiments/ablate.py`: a factorial ablation at one fixed arrival process.

Launch::

    python -m experiments.ablate
    python -m experiments.ablate --config=experiments/configs/ablate.py:smoke
    python -m experiments.ablate --config.workload.rate=6 --config.repeats=1

Factors (each a tuple of levels; every combination is one cell, all on the same workload):
attention_impl (operator: "xla" = blocked online-softmax over pages, "reference" = gather every
page then dense softmax), kv_layout (allocation: paged blocks vs contiguous max_model_len
reservation), scheduling (continuous vs static request-level batching); prefix caching stays on
(the engine default; the constructed prompts share nothing, so it could not matter here).

The default is sized so that memory binds: a pool of 64 usable blocks of 16 (1024 positions:
four contiguous reservations of ``max_model_len`` 256) under 192 requests arriving at 64 req/s
(3 s; a probe at 48 req/s left the xla + paged + continuous cell arrival-bound, its pool never
full), so the contiguous cells run at four sequences (queueing) and the paged ones until the
pool is full (preemptions). Three repeats, about 6 minutes on the 2-core CPU machine.
"""

import ml_collections

from experiments.configs import serve
from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = serve.get_config("smoke" if arg == "smoke" else "default")
    del c["real_arrivals"]  # serve's second (real-arrival) workload; a real trace: workload.azure
    c.factors = ml_collections.ConfigDict(dict(
        attention_impl=("xla", "reference"),
        kv_layout=("paged", "contiguous"),
        scheduling=("continuous", "static"),
    ))
    c.repeats = 3  # full replicates (cell order alternating); medians and spreads reported
    c.workload.num_requests = 192
    c.workload.rate = 64.0
    c.max_wall_s = 90.0
    c.plots = False
    if arg == "smoke":
        c.workload.num_requests = 4
        c.workload.rate = 20.0
        c.factors.attention_impl = ("xla",)
        c.repeats = 1
        c.max_wall_s = 60.0
    elif arg in ("cascade", "cascade_smoke"):
        # Cascade attention off / auto / on while serving (issue: TPOT with cascade on and off):
        # one minute of the real conversation trace's arrivals (time-scaled to what the tiny model
        # carries on CPU) with one shared system prompt ASSUMED (the traces have no contents),
        # labelled as a derivation. Prefix caching on, so the prompt's blocks are shared.
        c.factors = ml_collections.ConfigDict(dict(cascade_attention=("off", "auto", "on")))
        c.repeats = 1
        c.workload.azure = "conv"
        c.workload.window = (1200.0, 1260.0)
        c.workload.time_scale = 2.0
        c.workload.system_prompt_len = 96
        c.max_wall_s = 180.0
        if arg == "cascade_smoke":
            c.workload.window = (1200.0, 1203.0)
            c.factors.cascade_attention = ("off", "on")
    elif arg == "default":
        c.engine.num_blocks = 65  # 64 usable blocks of 16: four contiguous reservations of 256
    else:
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke, cascade, cascade_smoke")
    del c.arms
    # The factors set these engine fields per arm: unset in config.engine (a setting there would be
    # overridden, so the study refuses it).
    c.engine = engine_config_dict(**{**c.engine.to_dict(), **{k: None for k in c.factors.keys()}})
    return c
