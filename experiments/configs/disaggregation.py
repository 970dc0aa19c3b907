"""Config of `experiments/disaggregation.py`: colocated against disaggregated prefill/decode
replicas on the Azure LLM inference traces 2023, in simulation (``evidence: simulated`` over a
``real`` trace).

Launch::

    python -m experiments.disaggregation
    python -m experiments.disaggregation --config=experiments/configs/disaggregation.py:smoke
    python -m experiments.disaggregation --config.services="('conv',)" \\
        --config.gpus="((8, 'ib_ndr'),)"

Per trace (``services``), per fleet size and link (``gpus``: (GPUs, link name of
``paged.sim.link_transport.LINKS``)), per arm (colocated: every GPU a full replica; P:D for every
P in 1 .. G-1: P prefill-only and G-P decode-only replicas) and per offered rate (``rates_per_gpu``
of the trace, times G: the trace's arrivals time-scaled, burstiness kept), one simulated run;
SLO attainment (the fraction of all requests finished within both the TTFT and the TPOT bound)
for every pair of ``slos``; goodput per GPU (DistServe's form) = the highest per-GPU rate tried
whose attainment is at least ``attainment``.
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "Llama-3-8B"  # paged.sim.specs.MODELS
    c.services = ("conv", "code")
    c.gpus = ((8, "nvlink"), (16, "ib_ndr"))  # one HGX H200 node; two nodes, hand-overs over IB
    # Offered rate per GPU (req/s), per trace: the sweep (the same grid for every arm).
    c.rates_per_gpu = (("conv", (8.0, 12.0, 16.0, 20.0, 24.0)),
                       ("code", (2.0, 3.0, 4.0, 6.0, 8.0)))
    # (TTFT, TPOT) ms: loose (the fleet study's), tight TPOT, very tight TPOT, tight TTFT, both.
    c.slos = ((2000.0, 100.0), (2000.0, 25.0), (2000.0, 15.0), (500.0, 100.0), (250.0, 50.0))
    c.attainment = 0.9  # DistServe's goodput: the highest rate with >= 90 % of requests in SLO
    c.window = (1200.0, 1500.0)  # seconds of each trace (minutes 20-25); () = whole trace
    c.subsample = 1.0
    c.max_model_len = 8192
    c.hbm_gb = 141.0
    c.memory_utilization = 0.9  # KV = this x hbm - weights (bf16, embedding and LM head included)
    c.max_time_factor = 2.0  # a run ends at max_time_factor x the arrival span + 30 s
    c.prompt_seed = 0
    c.router = "least_loaded"  # among colocated replicas, and among prefill replicas
    c.plots = True
    c.seed = 0
    c.output_dir = ""
    c.engine = engine_config_dict(max_num_seqs=256, max_num_batched_tokens=2048,
                                  dtype="bfloat16", async_scheduling=False)
    if arg == "smoke":
        c.services = ("conv",)
        c.gpus = ((4, "nvlink"),)
        c.rates_per_gpu = (("conv", (2.0, 8.0)),)
        c.slos = ((2000.0, 100.0),)
        c.window = (1200.0, 1260.0)
        c.subsample = 0.5
        c.max_model_len = 4096
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
