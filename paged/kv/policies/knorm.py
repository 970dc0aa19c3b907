"""``knorm`` (Devoto et al., 2024; kvpress's ``KnormPress``): keeps the keys of smallest L2 norm
(a low key norm goes with high attention); scored per layer and KV head.

The norm is rounded to 1e-3: the same token's key computed by two different steps (a prefill
chunk, a decode) differs in the last bits, and the rounding makes such keys tie exactly, so the
earlier slot wins whatever step computed them (a repeated token's keys in the first layer differ
only by their rotation, which keeps the norm).
"""

from __future__ import annotations

from paged.kv.policies.base import KVPolicy


class KNorm(KVPolicy):
    name = "knorm"

    def scores(self, xp, keys, positions, valid, mass=None):
        norm = xp.sqrt(xp.sum(keys.astype(xp.float32) ** 2, axis=-1))
        return -xp.round(norm * 1000.0) / 1000.0
