"""``KVPolicyConfig``: which KV eviction policy a build runs and its budget (a setting of
``EngineConfig``; the policies are ``paged.kv.policies``, the realization
``paged.kv.blocks.compact`` and ``paged.engine.kv_compact``)."""

from __future__ import annotations

import dataclasses
import math

from paged.util import validate

# The names of ``paged.kv.policies.POLICIES`` (tests/test_kv_policies.py checks they agree),
# spelled here so that reading settings imports no policy.
METHODS = ("full", "streaming_llm", "knorm", "h2o", "snapkv", "pyramidkv")
POOLINGS = ("avg", "max")
ONCE = ("snapkv", "pyramidkv")  # methods that compress once, when the prompt's prefill ends


@dataclasses.dataclass(frozen=True)
class KVPolicyConfig:
    """How a sequence's KV is pruned.

    The policy is called when a sequence's prefill ends and then every ``interval`` decode steps
    (0: at the prefill's end only); it scores every slot per layer and KV head, and the engine
    keeps the ``budget`` best of each (layer, head), compacts them into fewer pages and frees
    the rest the same step (docs/kv-policies.md).

    Attributes:
      method: one of ``METHODS``: "full" (keeps everything), "streaming_llm" (``sink_tokens``
        first positions + the most recent ones), "knorm" (the keys of smallest L2 norm), "h2o"
        (the largest accumulated attention mass + the ``recent_tokens`` most recent), "snapkv"
        (the prompt's last ``window`` queries vote, pooled; the window kept), "pyramidkv"
        (SnapKV's votes with per-layer budgets decreasing with depth).
      budget: tokens kept per (layer, KV head) after a call: an int >= 1 (tokens), or a float in
        (0, 1] (that fraction of the sequence's tokens, rounded up). The same count in every
        layer and head (one KV length per sequence), PyramidKV's layers averaging it; which
        tokens may differ per (layer, head).
      interval: decode steps between calls after the prefill's (0: only at the prefill's end;
        "snapkv" and "pyramidkv" compress once: 0 only).
      sink_tokens: "streaming_llm": leading positions always kept (attention sinks).
      recent_tokens: "h2o": the most recent positions always kept: an int (tokens, < an int
        budget) or a float in [0, 1) (that fraction of the kept count, rounded down; the
        default 0.5 is H2O's equal split of heavy hitters and recent tokens).
      window: "snapkv", "pyramidkv": the observation window, the prompt's last queries that vote
        (its tokens are kept; < an int budget).
      kernel: "snapkv", "pyramidkv": the votes' 1-D pooling width over slots (odd; 1: none).
      pooling: "snapkv", "pyramidkv": "avg" (kvpress's) or "max".
      beta: "pyramidkv": the deepest layer keeps ``1 / beta`` of the average budget (>= 1).
    """

    method: str = "full"
    budget: int | float = 1.0
    interval: int = 0
    sink_tokens: int = 4
    recent_tokens: int | float = 0.5
    window: int = 64
    kernel: int = 5
    pooling: str = "avg"
    beta: float = 20.0

    def __post_init__(self):
        validate.one_of("method", self.method, METHODS)
        if isinstance(self.budget, float):
            validate.real("budget", self.budget, minimum=0.0, maximum=1.0, exclusive=True)
        else:
            validate.integer("budget", self.budget, minimum=1, maximum=validate.INT32_MAX)
        validate.integer("interval", self.interval, minimum=0, maximum=validate.INT32_MAX)
        validate.integer("sink_tokens", self.sink_tokens, minimum=0, maximum=validate.INT32_MAX)
        if isinstance(self.recent_tokens, float):
            validate.real("recent_tokens", self.recent_tokens, minimum=0.0, maximum=1.0)
            if self.recent_tokens == 1.0:
                raise ValueError("recent_tokens=1.0 must be < 1 (a fraction of the kept count; "
                                 "the rest are heavy hitters)")
        else:
            validate.integer("recent_tokens", self.recent_tokens, minimum=0,
                             maximum=validate.INT32_MAX)
        validate.integer("window", self.window, minimum=1, maximum=validate.INT32_MAX)
        validate.integer("kernel", self.kernel, minimum=1, maximum=validate.INT32_MAX)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel={self.kernel} must be odd (a centred pooling window)")
        validate.one_of("pooling", self.pooling, POOLINGS)
        validate.real("beta", self.beta, minimum=1.0)
        own = {"streaming_llm": "sink_tokens", "h2o": "recent_tokens", "snapkv": "window",
               "pyramidkv": "window"}.get(self.method)
        if own is not None and not isinstance(self.budget, float) \
                and isinstance(getattr(self, own), int) and getattr(self, own) >= self.budget:
            raise ValueError(f"{own}={getattr(self, own)} must be < budget={self.budget}: "
                             f"{self.method} keeps those tokens and then chooses the rest")
        if self.method in ONCE and self.interval:
            raise ValueError(f"interval={self.interval}: {self.method} compresses once, when the "
                             f"prompt's prefill ends (its votes come from the prompt's last "
                             f"queries); use interval=0")

    def keep_count(self, num_tokens: int) -> int:
        """Tokens kept of ``num_tokens`` (never more than there are)."""
        if isinstance(self.budget, float):
            return min(num_tokens, max(1, math.ceil(self.budget * num_tokens)))
        return min(num_tokens, self.budget)


__all__ = ["METHODS", "POOLINGS", "KVPolicyConfig"]
