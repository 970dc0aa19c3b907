"""EngineConfig: the one typed definition of every engine setting."""

from __future__ import annotations

import dataclasses
import numbers

KV_LAYOUTS = ("paged", "contiguous")
SCHEDULINGS = ("continuous", "static")
POLICIES = ("decode-first", "prefill-first")
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_IMPLS = ("auto", "xla", "reference", "pallas", "pallas_tpu", "pallas_gpu", "interpret",
                   "interpret_tpu", "interpret_gpu")
DTYPES = ("float32", "bfloat16")


def _positive_int(name, value, *, allow_none=False):
    if allow_none and value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _one_of(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be one of {allowed}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    Attributes:
      model: bundled model name ("tiny", "tiny-draft"); ignored when the engine is given params.
      block_size: tokens per KV page (paged layout).
      num_blocks: pages in the pool including the null page; ``None`` sizes the pool so that
        ``max_num_seqs`` requests of ``max_model_len`` tokens fit (no preemption).
      max_num_seqs: sequences per step at most.
      max_num_batched_tokens: tokens per step at most (prefill chunks + decodes).
      max_model_len: prompt + output tokens per sequence at most.
      kv_layout: "paged" (block tables) or "contiguous" (each running request reserves a buffer of
        ``max_model_len`` positions: the fixed-reservation baseline, with as many buffers as fit in
        the same pool bytes, at most ``max_num_seqs``).
      attention_impl: passed to ``pallas_kernels`` ("auto" picks by backend).
      scheduling: "continuous" (requests join and leave every step) or "static" (request-level
        batching: a batch runs until all of it finishes; the baseline).
      policy: "decode-first" (decodes first, chunked prefill fills the budget) or "prefill-first".
      preemption_mode: "recompute" (free and re-prefill) or "swap" (pages to host and back).
      num_host_blocks: host swap slots; ``None`` = as many as device blocks.
      enable_prefix_caching: share full blocks of equal prefixes across requests.
      quarantine_steps: device steps a freed block waits before reuse (0 disables the window).
      debug_checks: check block-manager invariants and NaN-poison freed pages every step.
      dtype: KV cache and activation dtype.
      seed: engine seed; requests without a seed derive theirs from it and their arrival order.
      request_timeout_s: default per-request timeout (seconds since arrival), ``None`` = none.
      max_steps_without_progress: guard that raises instead of spinning when nothing can run.
      min_token_bucket: smallest padded token count of a step (tokens are padded to powers of two
        from here up); raise it, and ``min_seq_bucket``, to compile fewer shapes.
      min_seq_bucket: smallest padded sequence count (``max_num_seqs`` makes it one bucket).
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
    preemption_mode: str = "recompute"
    num_host_blocks: int | None = None
    enable_prefix_caching: bool = True
    quarantine_steps: int = 1
    debug_checks: bool = False
    dtype: str = "float32"
    seed: int = 0
    request_timeout_s: float | None = None
    max_steps_without_progress: int = 8
    min_token_bucket: int = 8
    min_seq_bucket: int = 1

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "max_steps_without_progress", "min_token_bucket", "min_seq_bucket"):
            _positive_int(name, getattr(self, name))
        _positive_int("num_blocks", self.num_blocks, allow_none=True)
        if self.num_host_blocks is not None and (
                not isinstance(self.num_host_blocks, numbers.Integral) or self.num_host_blocks < 0):
            raise ValueError(f"num_host_blocks={self.num_host_blocks!r} must be None or >= 0")
        if not isinstance(self.quarantine_steps, numbers.Integral) or self.quarantine_steps < 0:
            raise ValueError(f"quarantine_steps={self.quarantine_steps!r} must be an integer >= 0")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 2 (block 0 is the null page)")
        _one_of("kv_layout", self.kv_layout, KV_LAYOUTS)
        _one_of("scheduling", self.scheduling, SCHEDULINGS)
        _one_of("policy", self.policy, POLICIES)
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _one_of("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _one_of("dtype", self.dtype, DTYPES)
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s!r} must be None or > 0")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def pool_blocks(self) -> int:
        """Pages in the paged pool, null page included."""
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_num_seqs * self.max_blocks_per_seq + 1

    def contiguous_slots(self) -> int:
        """Fixed-reservation buffers that fit in the same pool bytes (at most ``max_num_seqs``)."""
        positions = (self.pool_blocks() - 1) * self.block_size
        return min(self.max_num_seqs, positions // self.max_model_len)
