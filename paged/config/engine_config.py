"""EngineConfig: the one typed definition of every engine setting."""

from __future__ import annotations

import dataclasses
import warnings

from paged.config import support
from paged.config.eviction import parse_eviction
from paged.config.kv_policy import KVPolicyConfig
from paged.config.sparse_decode import SparseDecodeConfig
from paged.config.speculative import SpeculativeConfig
from paged.util import validate

KV_LAYOUTS = ("paged", "contiguous")
SCHEDULINGS = ("continuous", "static")
POLICIES = ("decode-first", "prefill-first", "lpm", "dfs-weight")  # lpm, dfs-weight: paged.step.waiting_order
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_IMPLS = ("auto", "xla", "reference", "pallas", "pallas_tpu", "pallas_gpu", "interpret",
                   "interpret_tpu", "interpret_gpu")
DTYPES = ("float32", "bfloat16")
# The names of ``pallas_kernels.quant.QUANT_DTYPES`` / ``GRANULARITIES`` (test_structure checks
# they agree), spelled here so that reading settings imports no JAX.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")  # "auto" = ``dtype``
KV_SCALE_GRANULARITIES = ("page", "token")
# Packed sub-byte pages (KIVI layout, pallas_kernels.packed): keys per channel, values per token,
# each sequence's open page in ``dtype`` until it fills (paged.kv.open_pages). ``kv_scale_
# granularity`` does not apply. Read by these attention impls (pallas_kernels.kivi.check_impl).
PACKED_KV_CACHE_DTYPES = ("int4", "int2")
# (pallas_kernels.kivi also reads them with the TPU-style kernels; the engine through those: untested)
PACKED_ATTENTION_IMPLS = ("auto", "xla", "reference", "interpret_gpu", "pallas_gpu")
CASCADE_MODES = ("auto", "on", "off")  # paged.step.cascade_plan.MODES
ROUTERS = ("prefix_aware", "round_robin", "least_loaded")  # paged.fleet.routing.POLICIES


# Impl names that need a particular backend (the others run everywhere, CPU included).
_IMPL_BACKENDS = {"pallas": ("gpu", "tpu"), "pallas_gpu": ("gpu",), "pallas_tpu": ("tpu",)}


def impls_for_backend(backend: str) -> tuple[str, ...]:
    """The ``attention_impl`` names that run on ``backend`` ("cpu", "gpu", "tpu")."""
    return tuple(i for i in ATTENTION_IMPLS if backend in _IMPL_BACKENDS.get(i, (backend,)))


def check_attention_impl(impl: str, backend: str) -> None:
    """Raises ValueError if ``impl`` cannot run on ``backend``.

    "auto", "xla", "reference" and the "interpret*" impls run everywhere; "pallas" compiles a
    kernel for gpu or tpu, "pallas_gpu" (Triton lowering) needs gpu and "pallas_tpu" (Mosaic)
    needs tpu. ``EngineConfig`` does not know the backend, so ``Engine`` calls this with
    ``jax.default_backend()`` when it is built.
    """
    validate.one_of("attention_impl", impl, ATTENTION_IMPLS)
    if impl not in impls_for_backend(backend):
        need = " or ".join(_IMPL_BACKENDS[impl])
        raise ValueError(f"attention_impl={impl!r} needs a {need} backend, but the backend is "
                         f"{backend!r}; impls that work here: {impls_for_backend(backend)}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings, all checked at construction.

    Integer fields take Python or numpy integers only (not ``bool``, not ``2.0``), boolean fields
    ``bool`` only (no truthiness: ``"no"`` is refused), floats must be finite and fit in float32
    (TypeError for a wrong type, ValueError for a value out of range). A pair of settings that
    may not be combined is refused here too, and the pairs involving the model or where it
    runs when the engine is built: one table, `paged.config.support`.

    Attributes:
      model: bundled model name ("tiny"; "tiny-draft", a smaller draft for speculation;
        "tiny-sliding", tiny's weights with a 32-token window in every layer; "tiny-mixed", that
        window in layers 1 and 3 only, see `paged.models.registry`) or a Hugging Face checkpoint
        directory (``config.json`` + safetensors, see `paged.models.hf`); ignored when the
        engine is given params. A model window not shorter than ``max_model_len`` never drops
        a token: the engine warns (`warn_long_window`).
      block_size: tokens per KV page (paged layout).
      num_blocks: pages in the pool including the null page; ``None`` sizes the pool so that
        ``max_num_seqs`` requests of ``max_model_len`` tokens fit (no preemption).
      max_num_seqs: sequences per step at most.
      max_num_batched_tokens: tokens per step at most (prefill chunks + decodes).
      max_model_len: prompt + output tokens per sequence at most.
      kv_layout: "paged" (block tables) or "contiguous" (each running request reserves a buffer of
        ``max_model_len`` positions: the fixed-reservation baseline, with as many buffers as fit in
        the same pool bytes, at most ``max_num_seqs``).
      attention_impl: passed to ``pallas_kernels`` ("auto" picks by backend). Whether it runs on
        the current backend is checked when the ``Engine`` is built (``check_attention_impl``).
      scheduling: "continuous" (requests join and leave every step) or "static" (request-level
        batching: a batch runs until all of it finishes; the baseline).
      policy: "decode-first" (decodes first, chunked prefill fills the budget) or "prefill-first";
        "lpm" (longest cached prefix first) and "dfs-weight" (SGLang's two cache-aware orders of
        the waiting queue, `paged.step.waiting_order`) run decode-first.
      policy_max_wait_s: "lpm" / "dfs-weight" only: the starvation guard; a request that has
        waited this many seconds is admitted before any cache-aware pick (oldest first).
      preemption_mode: "recompute" (free and re-prefill) or "swap" (pages to host and back).
      num_host_blocks: host swap slots; ``None`` = as many as device blocks.
      enable_prefix_caching: share full blocks of equal prefixes across requests.
      quarantine_steps: device steps a freed block waits before reuse (0 disables the window).
      debug_checks: check block-manager invariants and NaN-poison freed pages every step.
      dtype: KV cache and activation dtype.
      kv_cache_dtype: "auto" (pages in ``dtype``) or a quantized page format: "int8",
        "fp8_e4m3" or "fp8_e5m2" (symmetric, float32 scales; see ``pallas_kernels.quant``). The
        KV write quantizes; every kernel dequantizes the tiles it reads. "int4" / "int2": packed
        KIVI pages (keys per channel, values per token, asymmetric float16 scales and zeros),
        each running sequence's open page held in ``dtype`` until it fills
        (docs/quantized-kv.md).
      kv_scale_granularity: quantized pages only: "token" (a scale per (token, KV head)) or "page"
        (a scale per (page, KV head), fixed by the page's first token with 2x headroom; later
        tokens clip to it).
      seed: engine seed (an integer >= 0); requests without a seed derive theirs from it and
        their arrival order.
      request_timeout_s: default per-request timeout (seconds since arrival), ``None`` = none.
      max_steps_without_progress: guard that raises instead of spinning when nothing can run.
      min_token_bucket: smallest padded token count of a step (tokens are padded to powers of two
        from here up); raise it, and ``min_seq_bucket``, to compile fewer shapes.
      min_seq_bucket: smallest padded sequence count (``max_num_seqs`` makes it one bucket).
      async_scheduling: overlap the host and the device: step k+1 is scheduled, built and
        dispatched before step k's sampled tokens are read back (they are fed to step k+1 on
        device). Outputs are unchanged; a stop found one step late costs one wasted slot, and
        ``step()`` returns the outputs of the step dispatched by the previous call. ``False``
        waits for each step before scheduling the next (the ablation baseline).
      speculative: ``SpeculativeConfig`` to speculate (propose and verify several tokens per
        decode and step; ``paged.engine.spec_decode``), ``None`` not to. With it the steps run serially
        (``async_scheduling`` is not used: proposals need the last step's tokens on the host).
      data_parallel_size: engine replicas (D), each with its own devices, KV pool, block manager,
        scheduler and input batch; a router sends each request to one of them
        (``paged.engine.data_parallel``). The pool settings (``num_blocks``, ``max_num_seqs``, ...) are
        per replica.
      tensor_parallel_size: devices per replica (T): KV heads, attention projections and the MLP
        are sharded over them (``paged.engine.placement``). D x T devices are used, from
        ``jax.devices()`` unless the engine is given ``devices=``.
      router: how a request picks its replica when D > 1: "prefix_aware" (the replica holding
        the longest cached prefix, unless its load exceeds the least-loaded one's by more than
        ``router_load_threshold``), "round_robin" or "least_loaded" (``paged.fleet.routing``).
      router_load_threshold: ``prefix_aware`` only: the load gap (waiting + running requests)
        up to which cache affinity wins over balance.
      prefill_replicas: P of the D replicas only prefill (prompt and first token); the other
        D - P only decode, and each request's KV pages are handed from its prefill replica to a
        decode replica (``paged.fleet.handover``). 0 (the default): every replica does both. Needs
        P < D, the paged layout, continuous scheduling and no speculation.
      cascade_attention: shared-prefix (cascade) attention for decode-only steps
        (``paged.step.cascade_plan``): "off" (ordinary paged attention, the default), "on" (every
        group of two or more decodes whose block tables start with the same full blocks reads
        that prefix once) or "auto" (only when the cost rule says it pays). Outputs do not
        change (equal up to float rounding; greedy tokens identical in the tests).
      host_kv_cache_bytes: bytes of host memory for a second prefix-cache tier (0: none). Blocks
        the device pool evicts are copied there and loaded back on a later prefix hit
        (``paged.kv.blocks.host_tier``); as many whole blocks (all layers and KV heads, scales
        included) as fit. Separate from the swap slots of ``num_host_blocks``. Paged layout
        with prefix caching, single-process engines, full-attention models only; per replica.
      prefix_eviction: which cached block the prefix cache evicts first: ``"lru"`` (default),
        ``"lfu"``, ``"slru"``, ``"priority"`` (per-request ``SamplingParams.cache_priority`` and
        retention), ``"cost"``, ``"waiting"``, ``"tail_first"``, with ``:key=value`` parameters
        (``paged.config.eviction``; ``paged.kv.blocks.eviction``). The host tier uses the same.
      sparse_decode: ``SparseDecodeConfig`` to read, at decode, only the pages Quest selects per
        sequence and KV head (page key bounds kept beside the pages, counted as
        ``page_metadata``; docs/sparse-decode.md), ``None`` (the default) to read every page.
      kv_policy: a KV eviction policy (``KVPolicyConfig``: method, budget, interval): each
        sequence's KV is pruned to the budget when its prefill ends (and every ``interval``
        decode steps), the survivors compacted into fewer pages (docs/kv-policies.md). None:
        every token's KV is kept.
    """

    model: str = "tiny"
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 512
    kv_layout: str = "paged"
    attention_impl: str = "auto"
    scheduling: str = "continuous"
    policy: str = "decode-first"
    policy_max_wait_s: float = 10.0
    preemption_mode: str = "recompute"
    num_host_blocks: int | None = None
    enable_prefix_caching: bool = True
    quarantine_steps: int = 1
    debug_checks: bool = False
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    kv_scale_granularity: str = "token"
    seed: int = 0
    request_timeout_s: float | None = None
    max_steps_without_progress: int = 8
    min_token_bucket: int = 8
    min_seq_bucket: int = 1
    async_scheduling: bool = True
    speculative: SpeculativeConfig | None = None
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    router: str = "prefix_aware"
    router_load_threshold: int = 16
    cascade_attention: str = "off"
    prefill_replicas: int = 0
    host_kv_cache_bytes: int = 0
    prefix_eviction: str = "lru"
    sparse_decode: SparseDecodeConfig | None = None
    kv_policy: KVPolicyConfig | None = None

    def __new__(cls, *args, **kwargs):
        # A mistyped keyword gets "closest: ..." (as the studies' config keys do), not the
        # dataclass's bare "unexpected keyword argument".
        validate.known_keys("EngineConfig", kwargs, (f.name for f in dataclasses.fields(cls)))
        return super().__new__(cls)

    def __post_init__(self):
        # Integers reach int32 device arrays (positions, page ids), hence the upper bound.
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "max_steps_without_progress", "min_token_bucket", "min_seq_bucket"):
            validate.integer(name, getattr(self, name), minimum=1, maximum=validate.INT32_MAX)
        validate.integer("num_blocks", self.num_blocks, minimum=1, maximum=validate.INT32_MAX,
                         allow_none=True)
        validate.integer("num_host_blocks", self.num_host_blocks, minimum=0, allow_none=True)
        validate.integer("quarantine_steps", self.quarantine_steps, minimum=0)
        validate.integer("host_kv_cache_bytes", self.host_kv_cache_bytes, minimum=0)
        validate.integer("data_parallel_size", self.data_parallel_size, minimum=1, maximum=4096)
        validate.integer("tensor_parallel_size", self.tensor_parallel_size, minimum=1, maximum=4096)
        validate.integer("router_load_threshold", self.router_load_threshold, minimum=0)
        validate.one_of("router", self.router, ROUTERS)
        validate.one_of("cascade_attention", self.cascade_attention, CASCADE_MODES)
        validate.integer("prefill_replicas", self.prefill_replicas, minimum=0, maximum=4096)
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 2 (block 0 is the null page)")
        validate.integer("seed", self.seed, minimum=0)
        validate.boolean("enable_prefix_caching", self.enable_prefix_caching)
        validate.boolean("debug_checks", self.debug_checks)
        validate.boolean("async_scheduling", self.async_scheduling)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise TypeError(f"speculative={self.speculative!r:.80} must be None or a "
                            f"SpeculativeConfig")
        if self.sparse_decode is not None and not isinstance(self.sparse_decode,
                                                             SparseDecodeConfig):
            raise TypeError(f"sparse_decode={self.sparse_decode!r:.80} must be None or a "
                            f"SparseDecodeConfig")
        if self.kv_policy is not None and not isinstance(self.kv_policy, KVPolicyConfig):
            raise TypeError(f"kv_policy={self.kv_policy!r:.80} must be None or a KVPolicyConfig")
        validate.string("model", self.model)
        validate.one_of("kv_layout", self.kv_layout, KV_LAYOUTS)
        validate.one_of("scheduling", self.scheduling, SCHEDULINGS)
        validate.one_of("policy", self.policy, POLICIES)
        validate.real("policy_max_wait_s", self.policy_max_wait_s, minimum=0, allow_inf=True)
        validate.one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        validate.one_of("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        validate.one_of("dtype", self.dtype, DTYPES)
        validate.one_of("kv_cache_dtype", self.kv_cache_dtype,
                        KV_CACHE_DTYPES + PACKED_KV_CACHE_DTYPES)
        validate.one_of("kv_scale_granularity", self.kv_scale_granularity, KV_SCALE_GRANULARITIES)
        if self.kv_cache_dtype in PACKED_KV_CACHE_DTYPES and self.attention_impl not in \
                PACKED_ATTENTION_IMPLS:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} (packed KIVI pages) is read "
                             f"by attention_impl in {PACKED_ATTENTION_IMPLS} only, got "
                             f"{self.attention_impl!r}: the TPU-style and ragged Pallas kernels "
                             f"do not unpack sub-byte pages")
        if self.kv_cache_dtype not in ("auto", *PACKED_KV_CACHE_DTYPES):
            from pallas_kernels import quant
            quant.storage_dtype(self.kv_cache_dtype)  # fp8 this JAX lacks: ValueError now
        validate.real("request_timeout_s", self.request_timeout_s, minimum=0, exclusive=True,
                      allow_none=True)
        p, d = self.prefill_replicas, self.data_parallel_size
        if p and p >= d:
            raise ValueError(f"prefill_replicas={p} must be < data_parallel_size={d}: at least "
                             f"one replica must decode (0 prefill replicas: all do both)")
        parse_eviction(self.prefix_eviction)
        support.check_supported(self)  # the pairs of settings that may not be combined

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def pool_blocks(self) -> int:
        """Pages in the paged pool, null page included."""
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_num_seqs * self.max_blocks_per_seq + 1

    def pool_geometry(self) -> tuple[int, int]:
        """``(page_size, num_pages)`` of the KV pool, null page included: blocks of
        ``block_size`` (paged), or one page of ``max_model_len`` positions per request slot
        (contiguous).

        Raises:
          ValueError: the pool cannot hold one request of ``max_model_len`` tokens.
        """
        if self.kv_layout == "paged":
            num_pages = self.pool_blocks()
            if (num_pages - 1) * self.block_size < self.max_model_len:
                raise ValueError(
                    f"num_blocks={num_pages} (block_size={self.block_size}) cannot hold one "
                    f"request of max_model_len={self.max_model_len}: need at least "
                    f"{self.max_blocks_per_seq + 1} blocks including the null page")
            return self.block_size, num_pages
        slots = self.contiguous_slots()
        if slots < 1:
            raise ValueError(
                f"the pool ({self.pool_blocks()} blocks of {self.block_size}) cannot reserve "
                f"one contiguous buffer of max_model_len={self.max_model_len}")
        return self.max_model_len, slots + 1

    def contiguous_slots(self) -> int:
        """Fixed-reservation buffers that fit in the same pool bytes (at most ``max_num_seqs``)."""
        positions = (self.pool_blocks() - 1) * self.block_size
        return min(self.max_num_seqs, positions // self.max_model_len)


def engine_config(config: EngineConfig | None, backend: str) -> EngineConfig:
    """``config`` (``None``: the defaults) checked for an engine on ``backend``.

    ``Engine`` calls it first thing, with ``jax.default_backend()``, so that a wrong argument or
    an attention impl the backend cannot run fails at construction rather than at the first step.

    Raises:
      TypeError: ``config`` is not an ``EngineConfig`` (a dict of settings is refused too: build
        ``EngineConfig(**settings)``).
      ValueError: ``config.attention_impl`` cannot run on ``backend`` (``check_attention_impl``),
        or ``backend`` cannot store ``config.kv_cache_dtype`` (``quant.check_backend``).
    """
    if config is None:
        config = EngineConfig()
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig (or None for the defaults), got "
                        f"{type(config).__name__}: {config!r:.80}")
    check_attention_impl(config.attention_impl, backend)
    if config.kv_cache_dtype not in ("auto", *PACKED_KV_CACHE_DTYPES):
        from pallas_kernels import quant
        quant.check_backend(config.kv_cache_dtype, backend)
    return config


_WARNED_WINDOWS: set[tuple[int, int]] = set()


def warn_long_window(layer_windows, max_model_len: int) -> None:
    """Warns (once per pair of numbers in a process) when the model's longest sliding window is
    not shorter than ``max_model_len``: no sequence then grows past it, so its sliding layers
    attend to every token, as full attention does (likely not what was meant)."""
    window = max((w for w in layer_windows if w is not None), default=None)
    if window is None or window < max_model_len or (window, max_model_len) in _WARNED_WINDOWS:
        return
    _WARNED_WINDOWS.add((window, max_model_len))
    warnings.warn(f"sliding_window={window} is not shorter than max_model_len={max_model_len}: "
                  f"no sequence is long enough for the window to drop a token, so the sliding "
                  f"layers attend to everything (full attention)", UserWarning, stacklevel=3)
