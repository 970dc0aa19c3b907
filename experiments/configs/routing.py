"""Config of `experiments/routing.py`: router policies over data-parallel replicas, replica scaling
and the host time per step of D replicas.

Launch::

    python -m experiments.routing                                     # default (tiny model)
    python -m experiments.routing --config=experiments/configs/routing.py:smoke
    python -m experiments.routing --config.output_dir=experiments/results/routing

The study forces ``FORCED_DEVICES`` (4) host devices itself (``XLA_FLAGS=
--xla_force_host_platform_device_count=4``) when ``XLA_FLAGS`` is not set; with ``XLA_FLAGS`` set,
it must carry enough devices (``check`` says so otherwise).

The default serves a constructed multi-tenant workload: 12 system prompts of 32 to 512 tokens,
each shared by the users of one tenant (tenants drawn uniformly per request), a short Alpaca-like
user turn and answer after it (lengths at half the paper's scale), Poisson arrivals at 12
requests/s, on D = 4 replicas of the tiny model, each with a pool of 256 blocks of 16 (4096
positions: all twelve prompts, 2640 tokens, plus the running set only just fit on one replica).
Variants: ``default``, ``smoke`` (a small random model, a handful of requests; what the test
runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"  # bundled weights; "random-small" = small random model (tests)

    # Every engine setting (`engine_fields`); the pool settings are per replica.
    # data_parallel_size and router are set per run (policies, scaling, host bench).
    c.engine = engine_config_dict(
        block_size=16,
        num_blocks=257,  # 256 usable blocks (+ the null page) per replica
        max_num_seqs=32,
        max_num_batched_tokens=256,
        max_model_len=1024,
        attention_impl="xla",
        enable_prefix_caching=True,
        min_seq_bucket=32,  # one sequence bucket, token buckets 64/128/256: 3 shapes per replica
        min_token_bucket=64,
        data_parallel_size=None,
        router=None,
    )

    # Policies: every router on D replicas, the same requests (prefix cache emptied in between).
    c.data_parallel_size = 4
    c.routers = ("prefix_aware", "round_robin", "least_loaded")
    c.repeats = 2  # runs per policy, the order reversed every other repeat; medians reported

    w = c.workload = ml_collections.ConfigDict()
    w.kind = "alpaca"  # user turn + answer lengths: "alpaca" / "sharegpt" (lognormal) or "fixed"
    w.length_context = 1024  # lengths scale by length_context / 2048 (and are clipped to fit it)
    w.prompt_len = 0  # kind="fixed": the user's own tokens (BOS included); else unused
    w.output_len = 0  # kind="fixed": output tokens; else unused
    w.num_requests = 240
    w.rate = 12.0  # requests/s; Poisson when burstiness == 1
    w.burstiness = 1.0
    w.seed = 0
    # One system prompt per tenant (tokens after BOS), of different lengths.
    w.tenant_prefix_lens = (32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
    w.tenant_zipf = 0.0  # tenant popularity ~ 1 / rank**s; 0 = uniform

    # Replica scaling: a burst of requests (the same tenants) on D = 1, 2, 4; output throughput.
    s = c.scaling = ml_collections.ConfigDict()
    s.replicas = (1, 2, 4)  # () = no scaling runs
    s.router = "prefix_aware"
    s.num_requests = 384
    s.rate = 1000.0  # requests/s: all arrive within a fraction of a second (capacity)
    s.seed = 1
    s.repeats = 3  # runs per D, the order reversed every other repeat; medians reported

    # Host time per step: one replica with num_running decoding sequences vs `replicas` replicas
    # with num_running each; A/B interleaved rounds, each with the real device call and with it
    # stubbed out (isolated: host code alone). Its engines are config.engine with max_num_seqs =
    # min_seq_bucket = num_running, max_num_batched_tokens = min_token_bucket =
    # max(num_running, engine.min_token_bucket) (one step shape) and a pool of at least
    # engine.num_blocks that holds every sequence for the whole bench (no preemption).
    h = c.host_bench = ml_collections.ConfigDict()
    h.replicas = 4  # 0 = no host bench
    h.num_running = 64
    h.prompt_len = 16
    h.warmup_steps = 3
    h.steps = 16  # timed steps per block
    h.rounds = 8  # blocks per engine and mode; rounds alternate which engine goes first
    h.goal_ratio = 2.0  # the target: host time per step of D replicas <= 2 x one replica's

    c.ttft_slo_ms = 2000.0  # goodput only
    c.tpot_slo_ms = 200.0
    c.max_wall_s = 180.0  # per run: requests still in flight after this are aborted
    c.per_request = False  # keep the per-request arrays (ttfts, itls, ...) in the JSON
    c.output_dir = ""  # default results/routing/<UTC timestamp>/
    if arg == "smoke":
        c.model = "random-small"
        c.engine.block_size = 8
        c.engine.num_blocks = 65
        c.engine.max_num_seqs = 4
        c.engine.max_num_batched_tokens = 32
        c.engine.max_model_len = 128
        c.engine.min_seq_bucket = 4  # one step shape per replica
        c.engine.min_token_bucket = 32
        w.kind = "fixed"
        w.length_context = 128
        w.prompt_len = 3
        w.output_len = 4
        w.num_requests = 16
        w.rate = 20.0
        w.tenant_prefix_lens = (16, 24, 40)
        s.num_requests = 8
        c.repeats = 1
        s.repeats = 1
        h.num_running = 4
        h.prompt_len = 4
        h.warmup_steps = 1
        h.steps = 4
        h.rounds = 2
        c.max_wall_s = 60.0
        c.per_request = True
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
