"""Config of `experiments/ablate.py`: a factorial ablation at one fixed arrival process.

Launch::

    python -m experiments.ablate
    python -m experiments.ablate --config=experiments/configs/ablate.py:smoke
    python -m experiments.ablate --config.workload.rate=6

Factors (each a tuple of levels; every combination is one arm, all on the same workload):
attention_impl (operator: "xla" = blocked online-softmax over pages, "reference" = gather every
page then dense softmax), kv_layout (allocation: paged blocks vs contiguous max_model_len
reservation), scheduling (continuous vs static request-level batching), enable_prefix_caching.
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
        enable_prefix_caching=(True, False),
    ))
    c.workload.num_requests = 48
    c.workload.rate = 4.0
    c.max_wall_s = 60.0
    c.plots = False
    if arg == "smoke":
        c.workload.num_requests = 4
        c.workload.rate = 20.0
        c.factors.attention_impl = ("xla",)
        c.factors.enable_prefix_caching = (True,)
        c.max_wall_s = 60.0
    elif arg in ("cascade", "cascade_smoke"):
        # Cascade attention off / auto / on while serving (issue: TPOT with cascade on and off):
        # one minute of the real conversation trace's arrivals (time-scaled to what the tiny model
        # carries on CPU) with one shared system prompt ASSUMED (the traces have no contents),
        # labelled as a derivation. Prefix caching on, so the prompt's blocks are shared.
        c.factors = ml_collections.ConfigDict(dict(cascade_attention=("off", "auto", "on")))
        c.workload.azure = "conv"
        c.workload.window = (1200.0, 1260.0)
        c.workload.time_scale = 2.0
        c.workload.system_prompt_len = 96
        c.max_wall_s = 180.0
        if arg == "cascade_smoke":
            c.workload.window = (1200.0, 1203.0)
            c.factors.cascade_attention = ("off", "on")
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke, cascade, cascade_smoke")
    del c.arms
    # The factors set these engine fields per arm: unset in config.engine (a setting there would be
    # overridden, so the study refuses it).
    c.engine = engine_config_dict(**{**c.engine.to_dict(), **{k: None for k in c.factors.keys()}})
    return c
