"""Residency figures (`paged.kv.blocks.residency`) on hand-built sequences with a set clock:
block lifetime, idle time before eviction, reuse gap and distance, eviction regret, token hit
rate per tier; then ``kv_stats()`` and the server's ``/metrics`` carry them."""

from __future__ import annotations

import pytest

from paged.kv.block_manager import BlockManager
from paged.kv.blocks.residency import SECONDS_BUCKETS, Histogram

B = 4
PROMPT = list(range(1, 10))  # two full blocks and the final token


def _admit(bm, sid, prompt=PROMPT):
    bm.allocate(sid, prompt)
    bm.mark_computed(sid, len(prompt))


def _in_bucket(h: dict, x: float) -> int:
    """Observations in the bucket ``x`` falls in."""
    return next(c for b, c in h["buckets"].items() if b == "+Inf" or x <= float(b))


def test_histogram_buckets_are_prometheus_le_bounds():
    h = Histogram((1.0, 5.0))
    for x in (0.5, 1.0, 3.0, 9.0):
        h.observe(x)
    assert h.as_dict() == {"buckets": {"1.0": 2, "5.0": 1, "+Inf": 1}, "sum": 13.5, "count": 4}


def test_lifetime_idle_reuse_and_regret_by_hand():
    bm = BlockManager(8, B, quarantine_steps=0)
    bm.set_time(0.0)
    _admit(bm, "a")  # stores k1, k2 at t=0 (accesses 0, 1)
    bm.free("a")
    bm.set_time(1.0)
    _admit(bm, "b")  # hits k1, k2 at t=1 (accesses 2, 3)
    bm.free("b")
    bm.set_time(5.0)
    bm.evict_cached()  # both removed at t=5
    bm.set_time(7.0)
    _admit(bm, "c")  # needed again: recomputed and stored again (regret 2)
    d = bm.residency_stats()["device"]
    assert (d["query_tokens"], d["hit_tokens"]) == (27, 8)
    assert d["hit_rate"] == pytest.approx(8 / 27)
    gap, dist = d["kv_block_reuse_gap_seconds"], d["kv_block_reuse_distance_blocks"]
    assert gap["count"] == 2 and gap["sum"] == 2.0 and _in_bucket(gap, 1.0) == 2
    assert dist["count"] == 2 and dist["sum"] == 2  # one access of the other block between
    life, idle = d["kv_block_lifetime_seconds"], d["kv_block_idle_before_evict_seconds"]
    assert life["count"] == 2 and life["sum"] == 10.0 and _in_bucket(life, 5.0) == 2
    assert idle["count"] == 2 and idle["sum"] == 8.0 and _in_bucket(idle, 4.0) == 2
    assert d["eviction_regret_blocks"] == 2
    assert "host" not in bm.residency_stats()
    assert list(life["buckets"]) == [repr(float(b)) for b in SECONDS_BUCKETS] + ["+Inf"]


def test_host_tier_hits_are_not_regret_and_count_per_tier():
    bm = BlockManager(4, B, num_host_tier_blocks=4, quarantine_steps=0)  # 3 usable blocks
    bm.set_time(0.0)
    step = bm.begin_step()
    _admit(bm, "a")
    bm.free("a")
    bm.step_completed(step)
    step = bm.begin_step()
    _admit(bm, "x", [50 + i for i in range(9)])  # takes every block: a's go to the host tier
    bm.free("x")
    bm.step_completed(step)
    bm.step_completed(bm.begin_step())  # the offloads complete: loadable
    bm.set_time(3.0)
    step = bm.begin_step()
    assert bm.allocate("b", PROMPT) == 8  # from the host tier
    bm.step_completed(step)
    bm.mark_computed("b", len(PROMPT))
    res = bm.residency_stats()
    assert res["device"]["eviction_regret_blocks"] == 0  # loaded back, not recomputed
    assert res["host"]["hit_tokens"] == 8 and res["host"]["query_tokens"] == 27
    assert res["device"]["hit_tokens"] == 0 and res["device"]["query_tokens"] == 27
    gap = res["host"]["kv_block_reuse_gap_seconds"]
    assert (gap["count"], gap["sum"]) == (2, 6.0)  # both blocks, stored at 0, hit at 3


def test_kv_stats_and_metrics_serve_the_residency_figures():
    from server_utils import CONFIG

    from paged import Engine, SamplingParams
    from paged.server.metrics import ServerMetrics

    engine = Engine(CONFIG)
    prompt = "residency " * 6
    for _ in range(2):  # the second hits the first's blocks
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    res = engine.kv_stats()["residency"]["device"]
    assert res["hit_tokens"] > 0 and res["kv_block_reuse_gap_seconds"]["count"] > 0
    m = ServerMetrics("vllm")
    m.update_engine(engine)
    text = m.render().decode()
    for name in ("vllm:kv_block_lifetime_seconds_bucket", "vllm:kv_block_reuse_gap_seconds_count",
                 "vllm:kv_block_idle_before_evict_seconds_sum",
                 "vllm:kv_block_reuse_distance_blocks_bucket", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total",
                 "vllm:kv_eviction_regret_blocks_total"):
        assert name in text, name
    line = next(x for x in text.splitlines() if x.startswith("vllm:prefix_cache_hits_total"))
    assert float(line.split()[-1]) == res["hit_tokens"]


class _DigestResidency:
    """The residency figures as kept before block-id lists (one dict entry per digest, every
    removal binned at once): the reference the block-id figures must equal."""

    def __init__(self, remember):
        import collections

        from paged.kv.blocks.residency import DISTANCE_BUCKETS
        self.now, self.remember, self.keys, self.accesses = 0.0, remember, {}, 0
        self.removed_keys = collections.OrderedDict()
        self.h = {n: Histogram(b) for n, b in (("life", SECONDS_BUCKETS), ("idle", SECONDS_BUCKETS),
                                               ("gap", SECONDS_BUCKETS),
                                               ("dist", DISTANCE_BUCKETS))}
        self.q = self.hits = self.regret = 0

    def stored(self, d):
        self.keys[d] = (self.now, self.now, self.accesses)
        self.accesses += 1
        if self.removed_keys.pop(d, None) is not None:
            self.regret += 1

    def removed(self, d):
        e = self.keys.pop(d, None)
        if e is None or e[0] is None:
            return
        self.h["life"].observe(self.now - e[0])
        self.h["idle"].observe(self.now - e[1])
        self.removed_keys[d] = self.now
        if len(self.removed_keys) > self.remember:
            self.removed_keys.popitem(last=False)

    def hit(self, d):
        e = self.keys.get(d)
        if e is not None:
            self.h["gap"].observe(self.now - e[1])
            self.h["dist"].observe(self.accesses - e[2] - 1)
        self.keys[d] = (None if e is None else e[0], self.now, self.accesses)
        self.accesses += 1

    def as_dict(self):
        q = self.q
        return {"query_tokens": q, "hit_tokens": self.hits, "hit_rate": self.hits / q if q else 0.0,
                "kv_block_lifetime_seconds": self.h["life"].as_dict(),
                "kv_block_idle_before_evict_seconds": self.h["idle"].as_dict(),
                "kv_block_reuse_gap_seconds": self.h["gap"].as_dict(),
                "kv_block_reuse_distance_blocks": self.h["dist"].as_dict(),
                "eviction_regret_blocks": self.regret}


@pytest.mark.parametrize("seed", range(30))
def test_block_id_figures_equal_the_digest_keyed_ones_over_random_histories(seed, monkeypatch):
    """Random histories of stores, removals, hits, forgives and reads over a small index (a live
    digest on one block at a time, digests coming back after removal): ``as_dict`` equals the
    digest-keyed reference's after every step, with pending removals binned in bulk mid-way."""
    import random

    from paged.kv.blocks import residency as R

    class Key:
        def __init__(self, digest):
            self.digest = digest

    rng = random.Random(seed)
    remember = rng.choice((2, 5, 1000))
    monkeypatch.setattr(R, "REMEMBER", remember)
    n = rng.choice((3, 8, 20))
    ours, ref = R.Residency(n), _DigestResidency(remember)
    ours.PENDING = rng.choice((1, 3, 50))
    at: dict[int, bytes] = {}  # block -> digest indexed there
    digests = [bytes([i]) * 16 for i in range(3 * n)]
    for _ in range(rng.choice((20, 300))):
        op = rng.random()
        if op < 0.1:
            ours.now = ref.now = ref.now + rng.choice((0.0, 0.003, 0.25, 2.0, 40.0, 5000.0))
        elif op < 0.4:
            free = [b for b in range(n) if b not in at]
            live = set(at.values())
            if free and len(live) < len(digests):
                b, d = rng.choice(free), rng.choice([d for d in digests if d not in live])
                at[b] = d
                ours.stored(Key(d), b)
                ref.stored(d)
        elif op < 0.65 and at:
            b = rng.choice(sorted(at))
            d = at.pop(b)
            ours.removed(d, b)
            ref.removed(d)
        elif op < 0.85 and at:
            b = rng.choice(sorted(at))
            ours.hit(b)
            ref.hit(at[b])
        elif op < 0.9:
            d = rng.choice(digests)
            ours.forgive(d)
            ref.removed_keys.pop(d, None)
        elif op < 0.95:
            q = rng.randrange(20)
            h = rng.randrange(q + 1)
            ours.queried(q, h)
            ref.q, ref.hits = ref.q + q, ref.hits + h
        else:
            assert ours.as_dict() == ref.as_dict()
    assert ours.as_dict() == ref.as_dict()
    assert list(ours.removed_keys) == list(ref.removed_keys)


def test_histogram_observe_many_equals_observe_one_by_one():
    import random

    rng = random.Random(0)
    xs = [rng.choice((0.0, 0.01, 1.0, 7200.0, 1e5)) * rng.random() * 3 for _ in range(500)]
    xs += [0.01, 0.1, 1800.0, 7200.0]  # on the bounds
    a, b = Histogram(SECONDS_BUCKETS), Histogram(SECONDS_BUCKETS)
    for x in xs:
        a.observe(x)
    b.observe_many(xs[:7])
    b.observe_many([])
    b.observe_many(xs[7:])
    assert a.as_dict() == b.as_dict()


@pytest.mark.parametrize("seed", range(3))
def test_block_manager_feeds_the_same_lifetimes_and_regret_as_digest_keys(seed):
    """A block manager under random traffic (prefix hits, decodes, frees, evictions, a moving
    clock): its residency figures' lifetimes and regret equal a digest-keyed reference's that
    hears the same stores and removals through the KV-event seam (so the index's block ids are
    the right ones)."""
    import random

    ref = _DigestResidency(1 << 16)

    class Medium:
        def stored(self, key, block=None):
            ref.stored(key.digest)

        def removed(self, digest, block=None):
            ref.removed(digest)

    class Sink:
        def medium(self, name):
            return Medium()

        def cleared(self):
            pass

    rng = random.Random(seed)
    bm = BlockManager(24, B, quarantine_steps=0, debug=True)
    bm.set_event_sink(Sink())
    live, sid = [], 0
    for step in range(300):
        ref.now = float(step) * rng.choice((0.5, 1.0, 3.0))
        bm.set_time(ref.now)
        op = rng.random()
        if op < 0.35:
            family = rng.randrange(3)
            prompt = [family * 50 + i for i in range(rng.choice((4, 8, 12)))] + \
                [rng.randrange(1000, 1004) for _ in range(rng.randrange(1, 6))]
            if bm.can_allocate(prompt) and bm.allocate(sid, prompt) is not None:
                bm.mark_computed(sid, len(prompt))
                live.append((sid, len(prompt)))
                sid += 1
        elif op < 0.7 and live:
            i = rng.randrange(len(live))
            s, n = live[i]
            if bm.append_slots(s, [rng.randrange(1000, 1004)]) is not None:
                bm.mark_computed(s, n + 1)
                live[i] = (s, n + 1)
        elif op < 0.9 and live:
            bm.free(live.pop(rng.randrange(len(live)))[0])
        else:
            bm.evict_cached(rng.randrange(1, 4))
        d = bm.residency_stats()["device"]
        assert d["kv_block_lifetime_seconds"] == ref.h["life"].as_dict()
        assert d["eviction_regret_blocks"] == ref.regret
    assert ref.h["life"].count > 10 and ref.regret > 0
