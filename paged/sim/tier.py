"""A simulated replica's host KV tier: the link that prices its copies and what they cost so far.

The tier's bookkeeping is the engine's own (``paged.kv.blocks.host_tier``, inside the replica's
block manager); `SimTier` only prices each step's copies (`paged.sim.host_link.TierPricer`) and
keeps the link seconds and wire bytes they took.
"""

from __future__ import annotations

from paged.config.engine_config import EngineConfig
from paged.sim.host_link import PCIE5_X16, HostLink, TierPricer

_COUNTS = ("load_s", "offload_s", "load_wire_bytes", "offload_wire_bytes", "copy_only_steps",
           "offload_bound_steps")


class SimTier:
    """The pricing of one replica's host-tier copies (module docstring).

    Attributes:
      pricer: the step's copies in seconds on the link.
      num_blocks: host-tier slots (``host_kv_cache_bytes // bytes per block``).
      counts: link seconds and wire bytes of loads and offloads so far, copy-only steps, and
        steps whose offload outlasted their loads and compute.
    """

    def __init__(self, pricer: TierPricer, num_blocks: int):
        self.pricer = pricer
        self.num_blocks = num_blocks
        self.counts = dict.fromkeys(_COUNTS, 0)

    @classmethod
    def build(cls, config: EngineConfig, kv_spec, link: HostLink | None) -> SimTier | None:
        """The tier ``config.host_kv_cache_bytes`` asks for (None without one): the KV spec's
        ``host_tier_blocks`` slots of ``bytes_per_block`` each (``paged.kv.spec.KVSpec``)."""
        if not kv_spec.host_tier_blocks:
            return None
        pricer = TierPricer(PCIE5_X16 if link is None else link, kv_spec.bytes_per_block)
        return cls(pricer, kv_spec.host_tier_blocks)

    def step(self, block_manager, compute_s: float | None) -> float | None:
        """The step just begun with its host-tier copies priced: its duration, or ``None`` when
        it has no copies. ``compute_s``: the step model's time (``None``: a step that computes
        nothing)."""
        copies = block_manager.take_tier_copies()
        if not copies:
            return None
        pricer, c = self.pricer, self.counts
        load_s, offload_s = pricer.copy_times(copies)
        c["load_s"] += load_s
        c["offload_s"] += offload_s
        c["load_wire_bytes"] += pricer.wire_bytes(len(copies.load)) if copies.load else 0
        c["offload_wire_bytes"] += pricer.wire_bytes(len(copies.offload)) if copies.offload else 0
        if compute_s is None:
            c["copy_only_steps"] += 1
            return max(load_s, offload_s)
        if offload_s > load_s + compute_s:
            c["offload_bound_steps"] += 1
        return pricer.step_time(compute_s, load_s, offload_s)

    def stats(self, block_manager, scheduler) -> dict:
        """The tier's counters (``BlockManager.host_tier_stats``: hits, blocks offloaded and
        loaded, slots per state), its bytes, the link seconds of its copies and the seconds
        sequences waited in ``loading``."""
        per_block = self.pricer.bytes_per_block
        out = dict(block_manager.host_tier_stats())
        out.update(self.counts, bytes_per_block=per_block, bytes=out["num_blocks"] * per_block,
                   link=self.pricer.link.name, load_wait_s=scheduler.load_wait_s,
                   num_loads=scheduler.num_loads)
        return out
