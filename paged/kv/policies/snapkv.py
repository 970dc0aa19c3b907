"""``snapkv`` (Li et al., 2024; kvpress's ``SnapKVPress``): when the prompt's prefill ends, its
last ``window`` queries vote (their attention mass per layer and KV head, summed over the
group's query heads), the votes are pooled along the slots (``kernel`` wide, ``pooling`` "avg"
as kvpress or "max") so neighbours of a strong token come along, and the window itself is
kept.

The votes are the attention mass the engine accumulates during the prefill with only the window's
queries weighted (``mass_window``; `paged.kv.mass`), so they are the real prefill attention, not
a recomputation. The window's own votes are left out of the pooling (kvpress pools the keys
before the window only).
"""

from __future__ import annotations

from paged.kv.policies.base import KVPolicy

FORCED = 2.0**30  # above any vote


def pool(xp, x, kernel: int, how: str):
    """``x`` pooled along its last axis, ``kernel`` wide and centred ("same" size; zeros past
    the ends, which a sum of probabilities never goes below)."""
    if kernel == 1:
        return x
    r, n = kernel // 2, x.shape[-1]
    padded = xp.pad(x, [(0, 0)] * (x.ndim - 1) + [(r, r)])
    out = padded[..., 0:n]
    for d in range(1, kernel):
        part = padded[..., d:d + n]
        out = out + part if how == "avg" else xp.maximum(out, part)
    return out / kernel if how == "avg" else out


def window_scores(xp, config, positions, valid, mass):
    """SnapKV's scores: pooled votes outside the window, the window above all."""
    newest = xp.max(xp.where(valid, positions, -1), axis=-1, keepdims=True)
    window = positions > newest - config.window
    votes = xp.where(valid & ~window, mass, 0.0)
    return xp.where(window, FORCED + positions.astype(xp.float32),
                    pool(xp, votes, config.kernel, config.pooling))


class SnapKV(KVPolicy):
    name = "snapkv"

    @property
    def mass_window(self) -> int:  # the prompt's last ``window`` queries vote
        return self.config.window

    def scores(self, xp, keys, positions, valid, mass=None):
        return window_scores(xp, self.config, positions, valid, mass)
