"""``pyramidkv`` (Cai et al., 2024; kvpress's ``PyramidKVPress``): SnapKV's scores with a budget
per layer that decreases linearly with depth, averaging the configured budget.

Budgets follow kvpress's ``get_layer_budget`` (from the authors' KVCache-Factory): with ``k`` the
average budget of ``n`` tokens, window ``w`` and ``beta``, the deepest layer keeps ``k / beta``
and the first ``2k - k / beta`` (at most ``n - w``; then the deepest ``2k`` minus that), layers
in between on a line; when the line would leave ``[w, n]`` every layer keeps ``k`` (SnapKV).

Realized with one block table shared by all layers (docs/kv-policies.md): the pages kept are the
largest layer's; a layer keeping fewer hides its other slots from attention (per-layer holes in
the attention metadata), so those pages are not freed.
"""

from __future__ import annotations

from paged.kv.policies.base import KVPolicy
from paged.kv.policies.snapkv import window_scores


def layer_budgets(keep: int, num_tokens: int, num_layers: int, window: int,
                  beta: float) -> list[int]:
    """Tokens kept per layer, first to last (see the module docstring)."""
    low = keep / beta
    high = 2 * keep - low
    if high >= num_tokens - window:
        high = num_tokens - window
        low = 2 * keep - high
    if num_layers == 1 or not num_tokens >= high >= low >= window:
        return [keep] * num_layers
    step = (high - low) / (num_layers - 1)
    return [min(num_tokens, max(1, round(high - i * step))) for i in range(num_layers)]


class PyramidKV(KVPolicy):
    name = "pyramidkv"
    per_layer = True

    @property
    def mass_window(self) -> int:  # SnapKV's observation window votes
        return self.config.window

    def layer_keep(self, num_tokens: int, num_layers: int) -> list[int]:
        c = self.config
        return layer_budgets(self.keep_count(num_tokens), num_tokens, num_layers, c.window,
                             c.beta)

    def scores(self, xp, keys, positions, valid, mass=None):
        return window_scores(xp, self.config, positions, valid, mass)
