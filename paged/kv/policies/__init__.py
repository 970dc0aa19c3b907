"""KV eviction policies, one file each (``base.KVPolicy`` is the interface): ``POLICIES`` maps
``KVPolicyConfig.method`` to its class; ``build`` makes the one an engine runs."""

from __future__ import annotations

from paged.config.kv_policy import KVPolicyConfig
from paged.kv.policies.base import KVPolicy
from paged.kv.policies.full import Full
from paged.kv.policies.h2o import H2O
from paged.kv.policies.knorm import KNorm
from paged.kv.policies.pyramidkv import PyramidKV
from paged.kv.policies.snapkv import SnapKV
from paged.kv.policies.streaming_llm import StreamingLLM

POLICIES: dict[str, type[KVPolicy]] = {
    p.name: p for p in (Full, StreamingLLM, KNorm, H2O, SnapKV, PyramidKV)}


def build(config: KVPolicyConfig | None) -> KVPolicy | None:
    """The policy of ``config`` (None: none)."""
    return None if config is None else POLICIES[config.method](config)


__all__ = ["POLICIES", "KVPolicy", "build"]
