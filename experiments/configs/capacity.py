"""Config of `experiments/capacity.py`: the highest request rate each arm serves within the SLO.

Launch::

    python -m experiments.capacity
    python -m experiments.capacity --config=experiments/configs/capacity.py:smoke
    python -m experiments.capacity --config.tpot_slo_ms=150 --config.rates="(1,2,4,8)"
    python -m experiments.capacity --config.workload.azure=conv --config.workload.window="(1200,1230)"
    python -m experiments.capacity --config=experiments/configs/capacity.py:kv_dtype

At each rate of the grid every arm sees the same requests (same seed), ``rate * duration_s`` of
them, so every point offers load for the same time and a rate beyond an arm's throughput shows
up as a growing queue rather than as a short burst it drains. An arm meets the SLO at a rate when
every request finished and p99 TTFT and p99 TPOT are within the SLO. Its capacity is the
highest grid rate at which it and every lower rate met the SLO. The ratio of the first arm's
capacity to the second's is the headline (paged + continuous over contiguous + static). With
``workload.azure`` every point is the same window of a real Azure trace (``evidence: real``, its
lengths scaled by ``workload.length_scale`` to ``max_model_len``) time-scaled to the point's rate
(``duration_s`` unused; ``workload.time_scale`` must stay 1).

``kv_policy`` (and ``kv_policy_smoke``; ``kv_policy/full+h2o`` runs those arms only, a piece
of the grid) makes the KV policy the factor on SmolLM2-135M (`experiments/kv_policies.py`'s
engine-capacity column): fixed prompts of 512 tokens and 128 output tokens, a pool of 120
blocks of 16 (three full-KV requests at their end), each method at a budget of 25 % compacting
once when the prompt ends, so a policy's freed pages let more sequences decode at once.

``kv_dtype`` (and ``kv_dtype_smoke``) makes the KV format the factor: every arm is paged +
continuous and sized from one KV byte budget (``kv_budget_bytes``) in its own format, values plus
scales, so an int8 or fp8 arm gets about twice the blocks of a bfloat16 one. The budget, 2 MiB,
is 64 bfloat16 blocks of 16 on the bundled tiny model (4 layers, 2 KV heads of 64), which the
default workload fills (memory binds: the paged arm at 128 blocks already preempts at 48 req/s).
The bfloat16 arm is priced, not run, in bfloat16 (``kv_budget_priced_as``): it gets bfloat16's
blocks but stores and computes float32, because XLA on CPU runs a bfloat16 engine step about 6x
slower than a float32 one (the decode probe measures it), which would make its capacity a
measure of the CPU's bfloat16 arithmetic; the real float32 arm is run beside it. The first arm
is int8 (per-token scales), the second the bfloat16-priced one: the ratio is int8 over bfloat16.
"""

import ml_collections

from experiments.configs import serve


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = serve.get_config("smoke" if arg.endswith("smoke") else "default")
    del c["real_arrivals"]  # serve's second (real-arrival) workload; a real trace: workload.azure
    c.rates = (2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)
    c.duration_s = 20.0  # offered load per point: num_requests = rate * duration_s
    c.ttft_slo_ms = 1500.0
    c.tpot_slo_ms = 100.0
    c.max_drain_s = 60.0  # wall limit per point: the last arrival + this (then in-flight is aborted)
    c.stop_after_failures = 2  # an arm stops sweeping after this many consecutive misses
    # > 0: every arm's pool is the blocks these KV bytes hold in its own KV format
    # (engine.num_blocks must then be unset); 0: config.engine.num_blocks.
    c.kv_budget_bytes = 0
    # (arm name, dtype) pairs: an auto arm priced as if its pages were stored in dtype.
    c.kv_budget_priced_as = ()
    # num_seqs > 0: time each arm's decode step at this batch and prompt length first.
    c.probe = ml_collections.ConfigDict(dict(num_seqs=0, prompt_len=96, steps=24))
    if arg.startswith("kv_policy"):
        arg, _, only = arg.partition("/")  # "kv_policy/full+h2o": those arms only (a piece)
        arg = arg.removeprefix("kv_policy").removeprefix("_") or "default"
        if arg not in ("default", "smoke"):
            raise ValueError(f"unknown variant kv_policy_{arg!r}; known: kv_policy, "
                             "kv_policy_smoke (each optionally /<method>+<method>...)")
        kv_policy(c, smoke=arg == "smoke")
        if only:
            names = only.split("+")
            unknown = sorted(set(names) - {a[0] for a in c.arms})
            if unknown:
                raise ValueError(f"kv_policy arms {unknown} unknown; known: "
                                 f"{[a[0] for a in c.arms]}")
            c.arms = tuple(a for a in c.arms if a[0] in names)
        return c
    if arg.startswith("kv_dtype"):
        arg = arg.removeprefix("kv_dtype").removeprefix("_") or "default"
        if arg not in ("default", "smoke"):
            raise ValueError(f"unknown variant kv_dtype_{arg!r}; known: kv_dtype, kv_dtype_smoke")
        kv_dtype(c, smoke=arg == "smoke")
    if arg == "smoke":
        c.rates = (5.0, 50.0)
        c.duration_s = 0.2
        c.ttft_slo_ms = 5000.0
        c.tpot_slo_ms = 1000.0
        c.max_drain_s = 60.0
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke, kv_dtype, "
                         "kv_dtype_smoke, kv_policy, kv_policy_smoke")
    return c


def kv_dtype(c: ml_collections.ConfigDict, *, smoke: bool) -> None:
    """The KV format as the factor, at one KV byte budget (module docstring)."""
    c.engine.num_blocks = None  # sized per arm from kv_budget_bytes
    c.engine.kv_layout = "paged"
    c.engine.scheduling = "continuous"
    c.engine.kv_cache_dtype = None  # set per arm
    c.engine.kv_scale_granularity = None
    c.kv_budget_bytes = 2 * 2**20
    c.arms = (
        ("int8:token", dict(kv_cache_dtype="int8", kv_scale_granularity="token")),
        ("bfloat16 (priced)", dict(kv_cache_dtype="auto")),
        ("float32", dict(kv_cache_dtype="auto")),
        ("int8:page", dict(kv_cache_dtype="int8", kv_scale_granularity="page")),
        ("fp8_e4m3:token", dict(kv_cache_dtype="fp8_e4m3", kv_scale_granularity="token")),
    )
    c.kv_budget_priced_as = (("bfloat16 (priced)", "bfloat16"),)
    c.rates = (8.0, 12.0, 16.0, 24.0, 32.0, 40.0, 48.0, 64.0)
    c.stop_after_failures = 1  # capacity is fixed by the first miss; keeps the run ~20 min
    c.probe.num_seqs = 32
    if smoke:
        c.kv_budget_bytes = 40 * 2**10  # random-small: 20 bfloat16 blocks of 8, 10 float32
        c.arms = tuple(a for a in c.arms if a[0] in ("int8:token", "bfloat16 (priced)"))
        c.arms += (("fp8_e4m3:page", dict(kv_cache_dtype="fp8_e4m3", kv_scale_granularity="page")),)
        c.probe.num_seqs, c.probe.prompt_len, c.probe.steps = 2, 8, 2


# The KV policies compared at the SLO (``kv_policy``): the leaderboard's budget 25 %, once at the
# prompt's end. Methods whose kept counts agree free the same pages; they differ in step cost
# (H2O and SnapKV accumulate attention mass), so each is its own arm.
KV_POLICY_ARMS = ("full", "streaming_llm", "knorm", "h2o", "snapkv", "pyramidkv")


def kv_policy(c: ml_collections.ConfigDict, *, smoke: bool) -> None:
    """KV policies as the factor on SmolLM2-135M with a pool where memory binds (module
    docstring of `experiments/kv_policies.py`): long prompts, a few hundred decode tokens."""
    from paged.config.kv_policy import METHODS

    c.model = "smollm2-135m"
    c.engine.kv_layout = "paged"
    c.engine.scheduling = "continuous"
    c.engine.max_model_len = 640  # 512 prompt + 128 output
    c.engine.num_blocks = 121  # 120 usable blocks of 16: three full-KV requests at their end
    c.engine.max_num_seqs = 16
    c.engine.max_num_batched_tokens = 512
    c.engine.min_seq_bucket = 16
    c.engine.enable_prefix_caching = False  # distinct prompts; no hits to count
    c.workload.kind = "fixed"
    c.workload.prompt_len = 512
    c.workload.output_len = 128
    c.arms = tuple((m, dict(kv_policy=None if m == "full" else dict(method=m, budget=0.25)))
                   for m in KV_POLICY_ARMS if m in METHODS)
    c.rates = (0.4, 0.6, 0.8, 1.0, 1.2)
    c.duration_s = 20.0
    c.ttft_slo_ms = 3000.0
    c.tpot_slo_ms = 250.0
    c.max_drain_s = 60.0
    c.stop_after_failures = 1
    if smoke:
        c.model = "random-small"
        c.engine.max_model_len = 64
        c.engine.num_blocks = 17
        c.engine.block_size = 8
        c.engine.max_num_batched_tokens = 32
        c.engine.min_seq_bucket = 4
        c.engine.max_num_seqs = 4
        c.workload.prompt_len = 40
        c.workload.output_len = 16
        c.arms = c.arms[:2]
        c.rates = (5.0, 50.0)
        c.duration_s = 0.4
        c.ttft_slo_ms = 5000.0
        c.tpot_slo_ms = 1000.0
