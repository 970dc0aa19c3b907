"""``full``: keeps every token (the no-eviction baseline behind the same interface)."""

from __future__ import annotations

from paged.kv.policies.base import KVPolicy


class Full(KVPolicy):
    name = "full"

    def keep_count(self, num_tokens: int) -> int:
        return num_tokens

    def scores(self, xp, keys, positions, valid, mass=None):
        return xp.zeros(keys.shape[:3], xp.float32)
