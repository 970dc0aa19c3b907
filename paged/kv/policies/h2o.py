"""``h2o`` (Zhang et al., 2023, "Heavy-Hitter Oracle"): keeps the tokens with the largest
attention mass accumulated over every query so far (prefill and decode; per layer and KV head,
summed over the group's query heads), plus the ``recent_tokens`` most recent positions (a
count, or a fraction of the kept count: by default half, H2O's equal split).

The engine accumulates the mass in the cache beside the keys (`paged.kv.mass`); this file only
ranks it."""

from __future__ import annotations

from paged.kv.policies.base import KVPolicy

FORCED = 2.0**30  # above any mass (a probability sum is at most the number of queries)


class H2O(KVPolicy):
    name = "h2o"
    mass_window = 0  # every query counts

    def recent(self, xp, num_tokens):
        """The recent tokens kept of ``num_tokens`` (an array: traced in the engine)."""
        c = self.config
        if not isinstance(c.recent_tokens, float):
            return c.recent_tokens
        if isinstance(c.budget, float):
            keep = xp.maximum(1, xp.ceil(c.budget * num_tokens))
        else:
            keep = xp.minimum(num_tokens, c.budget)
        return xp.floor(c.recent_tokens * keep)

    def scores(self, xp, keys, positions, valid, mass=None):
        newest = xp.max(xp.where(valid, positions, -1), axis=-1, keepdims=True)
        recent = positions > newest - self.recent(xp, newest + 1)
        return xp.where(recent, FORCED + positions.astype(xp.float32), mass)
