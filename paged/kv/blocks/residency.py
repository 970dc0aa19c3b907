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
three list entries per block of the index (by block id). An event is two list appends to a log,
replayed in one loop when the figures are read or ``Residency.PENDING`` events wait, so a host
step pays its events' share of a replay every few hundred steps, not a call's work per key. Keys are told apart by block (two
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

    Every event (a store, a removal, a hit, a forgiven digest, a new ``now``) is one or two list
    appends to a log; the log is replayed in one tight loop (`_replay`) when the figures are
    read or ``PENDING`` events wait. The replay keeps per-key state in lists indexed by block id
    (the key indexed at that block): its store time, its last access and that access's number;
    ``None`` for a block holding no key; removals' lifetimes and idle times are binned in bulk
    (`Histogram.observe_many`).
    """

    PENDING = 4096

    def __init__(self, num_blocks: int):
        self._now = self._replayed_now = 0.0
        self._n = num_blocks
        # The log: ``_ops[i]`` a block (stored), ``~block`` (removed), ``block + n`` (hit),
        # ``2n`` (forgive) or ``2n + 1`` (a new now); ``_args[i]`` its key, digest or time.
        self._ops: list[int] = []
        self._args: list = []
        self._store: list[float | None] = [None] * num_blocks
        self._last: list[float | None] = [None] * num_blocks
        self._access: list[int] = [0] * num_blocks
        self._accesses = 0
        self._removed_keys: collections.OrderedDict = collections.OrderedDict()  # digest -> time
        self._lifetime = Histogram(SECONDS_BUCKETS)
        self._idle = Histogram(SECONDS_BUCKETS)
        self._reuse_gap = Histogram(SECONDS_BUCKETS)
        self._reuse_distance = Histogram(DISTANCE_BUCKETS)
        self.query_tokens = 0
        self.hit_tokens = 0
        self._regret = 0

    @property
    def now(self) -> float:
        return self._now

    @now.setter
    def now(self, now: float) -> None:
        if now != self._now:
            self._now = now
            self._ops.append(self._n * 2 + 1)
            self._args.append(now)
            if len(self._ops) >= self.PENDING:
                self._replay()

    # --- the index's listener ----------------------------------------------------------------
    def stored(self, key, block: int) -> None:
        self._ops.append(block)
        self._args.append(key)

    def removed(self, digest: Hashable, block: int) -> None:
        self._ops.append(~block)
        self._args.append(digest)
        if len(self._ops) >= self.PENDING:  # bounded even if the clock stands still
            self._replay()

    # --- admission -----------------------------------------------------------------------------
    def hit(self, block: int) -> None:
        """The key indexed at ``block`` was hit."""
        self._ops.append(block + self._n)
        self._args.append(None)
        if len(self._ops) >= self.PENDING:
            self._replay()

    def queried(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def forgive(self, digest: Hashable) -> None:
        """``digest`` comes back from another tier, not by recompute: no regret when stored."""
        self._ops.append(self._n * 2)
        self._args.append(digest)

    # --- the replay ----------------------------------------------------------------------------
    def _replay(self) -> None:
        """Applies the logged events in order (one loop, every branch inline)."""
        ops, args = self._ops, self._args
        if not ops:
            return
        self._ops, self._args = [], []
        n, forgive = self._n, self._n * 2
        store, last, access, rk = self._store, self._last, self._access, self._removed_keys
        accesses, regret = self._accesses, self._regret
        lifetimes, idles, gaps, dists = [], [], [], []
        now = self._replayed_now  # the clock at the log's start (each change is logged)
        for op, arg in zip(ops, args):
            if op >= 0:
                if op < n:  # stored
                    store[op] = now
                    last[op] = now
                    access[op] = accesses
                    accesses += 1
                    if rk and rk.pop(arg.digest, None) is not None:
                        regret += 1
                elif op < forgive:  # hit
                    b = op - n
                    t = last[b]
                    if t is not None:
                        gaps.append(now - t)
                        dists.append(accesses - access[b] - 1)
                    last[b] = now
                    access[b] = accesses
                    accesses += 1
                elif op == forgive:
                    rk.pop(arg, None)
                else:
                    now = arg
            else:  # removed
                b = ~op
                t = store[b]
                if t is None:
                    last[b] = None
                    continue
                store[b] = None
                lifetimes.append(now - t)
                idles.append(now - last[b])
                last[b] = None
                rk[arg] = now
                if len(rk) > REMEMBER:
                    rk.popitem(last=False)
        self._replayed_now = now
        self._accesses, self._regret = accesses, regret
        self._lifetime.observe_many(lifetimes)
        self._idle.observe_many(idles)
        self._reuse_gap.observe_many(gaps)
        self._reuse_distance.observe_many(dists)

    @property
    def lifetime(self) -> Histogram:
        """``kv_block_lifetime_seconds`` (the log replayed first)."""
        self._replay()
        return self._lifetime

    @property
    def idle(self) -> Histogram:
        """``kv_block_idle_before_evict_seconds`` (the log replayed first)."""
        self._replay()
        return self._idle

    @property
    def reuse_gap(self) -> Histogram:
        """``kv_block_reuse_gap_seconds`` (the log replayed first)."""
        self._replay()
        return self._reuse_gap

    @property
    def reuse_distance(self) -> Histogram:
        """``kv_block_reuse_distance_blocks`` (the log replayed first)."""
        self._replay()
        return self._reuse_distance

    @property
    def regret_blocks(self) -> int:
        """Keys stored again after their removal (the log replayed first)."""
        self._replay()
        return self._regret

    @property
    def removed_keys(self) -> collections.OrderedDict:
        """The remembered removals, digest -> time (the log replayed first)."""
        self._replay()
        return self._removed_keys

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
