"""Request routing over data-parallel replicas: round robin, least loaded, prefix aware.

A ``Router`` picks, for each new request, the replica that serves it. It never reads device
memory: a replica exposes its queue sizes (``num_waiting``, ``num_running``) and a host-side query
of how many leading prompt tokens its prefix cache already holds (``cached_prefix_tokens``).
Anything with those three members is a replica (the simulator's ``SimReplica``; an engine wrapped
by ``EngineReplica``).

Policies:

* ``round_robin``: replicas in turn.
* ``least_loaded``: the smallest ``num_waiting + num_running``; ties go to the replica after the
  last one picked (so an idle fleet is filled in turn, not replica 0 first).
* ``prefix_aware``: the replica whose cache holds the longest prefix of the prompt wins, unless
  its load exceeds the least-loaded replica's by more than ``load_threshold`` requests; ties
  between equally long hits, and prompts no replica holds (cold), go to the least loaded. This is
  the rule of SGLang's cache-aware load balancer (cache affinity first, load balance when the
  imbalance passes a threshold).

``BlockManager.cached_prefix_tokens(tokens)`` answers the prefix query without side effects: it
walks the prompt's full blocks through the manager's prefix-cache index exactly as admission does
(same digest function, full-key and content-version checks), but touches no pool state, no
admission memo and no counters. With a host tier (``EngineConfig.host_kv_cache_bytes``) the
query sees both tiers: the tokens after the device hits that the host tier holds count
``HOST_TIER_WEIGHT`` (one half) each, since a host hit costs a host-to-device copy and a step in
``loading`` where a device hit costs nothing (a chosen weight, not a measured one). ``PrefixProbe``
shares the digests of
one prompt across replicas whose managers use the same block size, hash function and salt, so a
fleet of N replicas hashes each prompt once, not N times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from paged.kv.blocks.probe import PrefixProbe

POLICIES = ("round_robin", "least_loaded", "prefix_aware")
HOST_TIER_WEIGHT = 0.5  # a host-tier hit token, in device hit tokens, for routing


class Replica(Protocol):
    """What a router reads from a replica (host-side state only)."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: bytes | None = None,
                             probe: PrefixProbe | None = None) -> int: ...


# --- the prefix query ------------------------------------------------------------------------
def cached_prefix_tokens(bm, token_ids: Sequence[int], cache_salt: bytes | None = None,
                         probe: PrefixProbe | None = None) -> int:
    """A ``BlockManager``'s side-effect-free prefix query over both tiers: device hit tokens
    plus ``HOST_TIER_WEIGHT`` times the host tier's (``bm.tiered_prefix_tokens``)."""
    device, host = bm.tiered_prefix_tokens(token_ids, cache_salt=cache_salt, probe=probe)
    return device + int(host * HOST_TIER_WEIGHT)


class EngineReplica:
    """A ``paged.Engine`` seen as a router's replica (host state only)."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def num_waiting(self) -> int:
        return self.engine.core.num_waiting

    @property
    def num_running(self) -> int:
        """Running or loading (``HostCore.num_running``; the sum is ``HostCore.load()``)."""
        return self.engine.core.num_running

    def cached_prefix_tokens(self, token_ids, cache_salt=None, probe=None) -> int:
        return cached_prefix_tokens(self.engine.block_manager, token_ids, cache_salt, probe)


# --- the router ------------------------------------------------------------------------------
@dataclasses.dataclass
class Router:
    """Picks a replica per request.

    Attributes:
      policy: one of ``POLICIES``.
      load_threshold: ``prefix_aware`` only: the prefix winner is kept while its load is at most
        the least-loaded replica's plus this many requests (waiting + running).
      num_routed: requests routed so far, per decision kind (for reports).
    """

    policy: str = "least_loaded"
    load_threshold: int = 16
    num_routed: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {POLICIES}")
        if isinstance(self.load_threshold, bool) or not isinstance(self.load_threshold, int) \
                or self.load_threshold < 0:
            raise ValueError(f"load_threshold={self.load_threshold!r} must be an int >= 0")
        self._next = 0

    def _count(self, kind: str) -> None:
        self.num_routed[kind] = self.num_routed.get(kind, 0) + 1

    def _least_loaded(self, loads: list[int]) -> int:
        """The first replica of least load from ``self._next`` on, cyclically."""
        low = min(loads)
        try:
            return loads.index(low, self._next % len(loads))
        except ValueError:  # none at or after ``_next``: the first one before it
            return loads.index(low)

    def route(self, token_ids: Sequence[int], replicas: Sequence[Replica],
              cache_salt: bytes | None = None, loads: list[int] | None = None) -> int:
        """The index of the replica that serves a request with prompt ``token_ids``.

        Args:
          loads: each replica's ``num_waiting + num_running`` now, if the caller keeps them
            (the simulator refreshes only the replicas that changed since the last arrival);
            default: read from ``replicas``.

        Raises:
          ValueError: no replicas, or ``loads`` of another length.
        """
        n = len(replicas)
        if not n:
            raise ValueError("no replicas to route to")
        if n == 1:
            self._count("only")
            return 0
        if self.policy == "round_robin":
            i = self._next % n
            self._count("round_robin")
        else:
            if loads is None:
                loads = [r.num_waiting + r.num_running for r in replicas]
            elif len(loads) != n:
                raise ValueError(f"{len(loads)} loads for {n} replicas")
            else:
                loads = list(loads)
            i = self._least_loaded(loads)
            kind = "least_loaded"
            if self.policy == "prefix_aware":
                probe = PrefixProbe(token_ids)
                hits = [r.cached_prefix_tokens(token_ids, cache_salt, probe) for r in replicas]
                best = max(hits)
                if best == 0:
                    kind = "cold"
                else:
                    tied = [j for j in range(n) if hits[j] == best]
                    j = min(tied, key=lambda j: (loads[j], (j - self._next) % n))
                    if loads[j] - loads[i] <= self.load_threshold:
                        i, kind = j, "prefix"
                    else:
                        kind = "overloaded"
            self._count(kind)
        self._next = (i + 1) % n
        return i


__all__ = ["HOST_TIER_WEIGHT", "POLICIES", "EngineReplica", "PrefixProbe", "Replica", "Router", "cached_prefix_tokens"]
