"""Residency of prefix-cache blocks: how long keys live, sit idle, come back, and are missed.

One `Residency` per tier (the device index, the host tier's index) listens to its index (a key
stored or removed, `paged.kv.blocks.prefix_index.PrefixCacheIndex.events`) and to admission (the
keys a prompt hit). The clock is the host step's ``now`` (``BlockManager.set_time``: wall time in
the engine, simulated time in the simulator). What it measures, as vLLM's KV cache residency
metrics (vllm PR #27793) where vLLM has one:

* ``kv_block_lifetime_seconds``: from a key's store to its removal (an eviction, or its block
  rewritten in place);
* ``kv_block_idle_before_evict_seconds``: from a key's last access (its store or its last hit)
  to its removal;
* ``kv_block_reuse_gap_seconds``: between consecutive accesses of a key (a hit after its store
  or an earlier hit);
* ``kv_block_reuse_distance_blocks``: block accesses of the tier (stores and hits of any key)
  between consecutive accesses of one key: accesses, not distinct keys, so an upper bound of
  the LRU stack distance;
* eviction regret: keys stored again after the tier removed them (the last ``REMEMBER``
  removals are remembered): on the device, a block a later request needed and recomputed
  because it was evicted (a block loaded back from the host tier is not counted); on the host,
  a block offloaded again after the host evicted it;
* token hits per tier (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` for the device;
  its ``external_prefix_cache_*`` for the host tier): the device is asked for every prompt token,
  the host tier for those after the device's hits.

Histograms have fixed buckets (``SECONDS_BUCKETS``, ``DISTANCE_BUCKETS``, Prometheus' ``le``
bounds plus +Inf) and keep counts, a sum and a count, so memory stays bounded; per-key state is
three list entries per block of the index (by block id: a store or removal touches no dict but
the remembered removals), and removals are binned in bulk. Keys are told apart by block (two
keys of one digest, which only a weak ``hash_fn`` makes, each have their own entry); regret is
told by digest.
"""

from __future__ import annotations

import collections
from bisect import bisect_left
from collections.abc import Hashable, Sequence

import numpy as np

SECONDS_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 7200.0)
DISTANCE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
REMEMBER = 1 << 16  # removed device keys remembered for eviction regret


class Histogram:
    """Fixed buckets: ``counts[i]`` observations ``<= bounds[i]`` and above the bound before
    (the last entry: above every bound), their sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float) -> None:
        self.counts[bisect_left(self.bounds, x)] += 1
        self.sum += x
        self.count += 1

    def observe_many(self, xs: Sequence[float]) -> None:
        """``observe(x)`` for each of ``xs`` in order, in bulk: the same counts, and the same
        sum bit for bit (``cumsum`` adds left to right, as the loop does)."""
        if not len(xs):
            return
        a = np.asarray(xs, dtype=np.float64)
        idx = np.searchsorted(np.asarray(self.bounds, dtype=np.float64), a, side="left")
        for i, c in enumerate(np.bincount(idx, minlength=len(self.counts)).tolist()):
            self.counts[i] += c
        self.sum = float(np.cumsum(np.concatenate(([self.sum], a)))[-1])
        self.count += len(a)

    def as_dict(self) -> dict:
        """``{"buckets": {upper bound: observations in the bucket (not cumulative), ...,
        "+Inf": ...}, "sum", "count"}`` (bounds as strings: a data-parallel engine's stats add
        replicas' dicts key by key)."""
        names = [repr(float(b)) for b in self.bounds] + ["+Inf"]
        return {"buckets": dict(zip(names, self.counts)), "sum": self.sum, "count": self.count}


class Residency:
    """One tier's residency figures (module docstring) for an index of ``num_blocks`` blocks.

    Per-key state lives in lists indexed by block id (the key indexed at that block): its store
    time, its last access and that access's number; ``None`` for a block holding no key. A
    removal only appends the key's lifetime and idle time to two pending lists, binned in bulk
    (`Histogram.observe_many`) when they reach ``PENDING`` entries or the figures are read.
    """

    PENDING = 4096

    def __init__(self, num_blocks: int):
        self.now = 0.0
        self._store: list[float | None] = [None] * num_blocks
        self._last: list[float | None] = [None] * num_blocks
        self._access: list[int] = [0] * num_blocks
        self._accesses = 0
        self._lifetimes: list[float] = []  # removals not binned yet
        self._idles: list[float] = []
        self.removed_keys: collections.OrderedDict = collections.OrderedDict()  # digest -> time
        self._lifetime = Histogram(SECONDS_BUCKETS)
        self._idle = Histogram(SECONDS_BUCKETS)
        self.reuse_gap = Histogram(SECONDS_BUCKETS)
        self.reuse_distance = Histogram(DISTANCE_BUCKETS)
        self.query_tokens = 0
        self.hit_tokens = 0
        self.regret_blocks = 0

    # --- the index's listener ----------------------------------------------------------------
    def stored(self, key, block: int) -> None:
        now = self.now
        self._store[block] = now
        self._last[block] = now
        self._access[block] = self._accesses
        self._accesses += 1
        rk = self.removed_keys
        if rk and rk.pop(key.digest, None) is not None:  # needed again after its removal
            self.regret_blocks += 1

    def removed(self, digest: Hashable, block: int) -> None:
        t = self._store[block]
        if t is None:
            self._last[block] = None
            return
        now = self.now
        self._store[block] = None
        self._lifetimes.append(now - t)
        self._idles.append(now - self._last[block])
        self._last[block] = None
        rk = self.removed_keys
        rk[digest] = now
        if len(rk) > REMEMBER:
            rk.popitem(last=False)
        if len(self._lifetimes) >= self.PENDING:
            self._bin()

    def _bin(self) -> None:
        self._lifetime.observe_many(self._lifetimes)
        self._idle.observe_many(self._idles)
        self._lifetimes, self._idles = [], []

    @property
    def lifetime(self) -> Histogram:
        """``kv_block_lifetime_seconds`` (pending removals binned first)."""
        self._bin()
        return self._lifetime

    @property
    def idle(self) -> Histogram:
        """``kv_block_idle_before_evict_seconds`` (pending removals binned first)."""
        self._bin()
        return self._idle

    # --- admission -----------------------------------------------------------------------------
    def hit(self, block: int) -> None:
        """The key indexed at ``block`` was hit."""
        last = self._last[block]
        if last is not None:
            self.reuse_gap.observe(self.now - last)
            self.reuse_distance.observe(self._accesses - self._access[block] - 1)
        self._last[block] = self.now
        self._access[block] = self._accesses
        self._accesses += 1

    def queried(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def forgive(self, digest: Hashable) -> None:
        """``digest`` comes back from another tier, not by recompute: no regret when stored."""
        self.removed_keys.pop(digest, None)

    def as_dict(self) -> dict:
        q = self.query_tokens
        return {"query_tokens": q, "hit_tokens": self.hit_tokens,
                "hit_rate": self.hit_tokens / q if q else 0.0,
                "kv_block_lifetime_seconds": self.lifetime.as_dict(),
                "kv_block_idle_before_evict_seconds": self.idle.as_dict(),
                "kv_block_reuse_gap_seconds": self.reuse_gap.as_dict(),
                "kv_block_reuse_distance_blocks": self.reuse_distance.as_dict(),
                "eviction_regret_blocks": self.regret_blocks}


class Listeners:
    """Several listeners of one index (``stored(key, block)`` / ``removed(digest, block)``), in
    order."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence):
        self.parts = tuple(parts)

    def stored(self, key, block: int) -> None:
        for p in self.parts:
            p.stored(key, block)

    def removed(self, digest, block: int) -> None:
        for p in self.parts:
            p.removed(digest, block)


def listeners(parts: Sequence):
    """What an index's ``events`` slot holds for ``parts`` (None, one, or `Listeners`)."""
    parts = [p for p in parts if p is not None]
    return None if not parts else parts[0] if len(parts) == 1 else Listeners(parts)


__all__ = ["DISTANCE_BUCKETS", "REMEMBER", "SECONDS_BUCKETS", "Histogram", "Listeners",
           "Residency", "listeners"]
