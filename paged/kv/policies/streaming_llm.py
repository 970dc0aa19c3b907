"""``streaming_llm`` (Xiao et al., 2023): the first ``sink_tokens`` positions (attention sinks)
and the most recent ones up to the budget."""

from __future__ import annotations

from paged.kv.policies.base import KVPolicy


class StreamingLLM(KVPolicy):
    name = "streaming_llm"

    def scores(self, xp, keys, positions, valid, mass=None):
        pos = positions.astype(xp.float32)
        sink = positions < self.config.sink_tokens
        return xp.where(sink, 2.0**30, pos)  # sinks first, then the most recent
