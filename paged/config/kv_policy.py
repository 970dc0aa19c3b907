"""``KVPolicyConfig``: which KV eviction policy a build runs and its budget (a setting of
``EngineConfig``; the policies are ``paged.kv.policies``, the realization
``paged.kv.blocks.compact`` and ``paged.engine.kv_compact``)."""

from __future__ import annotations

import dataclasses
import math

from paged.util import validate

# The names of ``paged.kv.policies.POLICIES`` (tests/test_kv_policies.py checks they agree),
# spelled here so that reading settings imports no policy.
METHODS = ("full", "streaming_llm", "knorm")


@dataclasses.dataclass(frozen=True)
class KVPolicyConfig:
    """How a sequence's KV is pruned.

    The policy is called when a sequence's prefill ends and then every ``interval`` decode steps
    (0: at the prefill's end only); it scores every slot per layer and KV head, and the engine
    keeps the ``budget`` best of each (layer, head), compacts them into fewer pages and frees
    the rest the same step (docs/kv-policies.md).

    Attributes:
      method: one of ``METHODS``: "full" (keeps everything), "streaming_llm" (``sink_tokens``
        first positions + the most recent ones), "knorm" (the keys of smallest L2 norm).
      budget: tokens kept per (layer, KV head) after a call: an int >= 1 (tokens), or a float in
        (0, 1] (that fraction of the sequence's tokens, rounded up). The same count in every
        layer and head (one KV length per sequence); which tokens may differ per (layer, head).
      interval: decode steps between calls after the prefill's (0: only at the prefill's end).
      sink_tokens: "streaming_llm": leading positions always kept (attention sinks).
    """

    method: str = "full"
    budget: int | float = 1.0
    interval: int = 0
    sink_tokens: int = 4

    def __post_init__(self):
        validate.one_of("method", self.method, METHODS)
        if isinstance(self.budget, float):
            validate.real("budget", self.budget, minimum=0.0, maximum=1.0, exclusive=True)
        else:
            validate.integer("budget", self.budget, minimum=1, maximum=validate.INT32_MAX)
        validate.integer("interval", self.interval, minimum=0, maximum=validate.INT32_MAX)
        validate.integer("sink_tokens", self.sink_tokens, minimum=0, maximum=validate.INT32_MAX)
        if self.method == "streaming_llm" and not isinstance(self.budget, float) \
                and self.sink_tokens >= self.budget:
            raise ValueError(f"sink_tokens={self.sink_tokens} must be < budget={self.budget}: "
                             f"StreamingLLM keeps the sinks and then the most recent tokens")

    def keep_count(self, num_tokens: int) -> int:
        """Tokens kept of ``num_tokens`` (never more than there are)."""
        if isinstance(self.budget, float):
            return min(num_tokens, max(1, math.ceil(self.budget * num_tokens)))
        return min(num_tokens, self.budget)


__all__ = ["METHODS", "KVPolicyConfig"]
