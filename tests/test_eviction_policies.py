"""Prefix-cache eviction policies (`paged.kv.blocks.eviction`): each order on hand-built access
sequences, priority and retention through the block manager, every policy under the stateful
block-manager machine (invariants after every step) and with the host tier, and bad settings as
one clear error."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis.stateful import rule
from test_block_manager_stateful import BlockManagerMachine, _run

from paged.config.engine_config import EngineConfig
from paged.config.eviction import EVICTION_POLICIES
from paged.kv.block_manager import BlockManager
from paged.kv.blocks.eviction import make_order
from paged.request.sampling import SamplingParams


class _Key:
    def __init__(self, parent, digest):
        self.parent, self.digest = parent, digest


class _Index:
    """Keys of blocks 1..6: chain 1 <- 2 <- 3, chain 4 <- 5, and 6 alone."""

    def __init__(self):
        k1 = _Key(None, "d1")
        k2 = _Key(k1, "d2")
        k4 = _Key(None, "d4")
        self.key = [None, k1, k2, _Key(k2, "d3"), k4, _Key(k4, "d5"), _Key(None, "d6")]


def _order(spec, **kw):
    return make_order(spec, 8, _Index(), 16)


def _fill(order, blocks, hits=()):
    if order.on_take is not None:
        order.on_take(range(8))
    for b in hits:
        if order.on_hit is not None:
            order.on_hit(b)
    for b in blocks:
        order[b] = f"d{b}"


def _drain(order):
    out = []
    while order:
        b, digest = order.evict_one()
        assert digest == f"d{b}"
        out.append(b)
    return out


def test_lru_victims_in_release_order_and_touch():
    o = _order("lru")
    _fill(o, [1, 2, 3, 4])
    del o[2]
    o[2] = "d2"
    o.touch(1)
    assert list(o) == [3, 4, 2, 1] == _drain(o)


def test_lfu_fewest_uses_first_lru_among_equals():
    o = _order("lfu")
    _fill(o, [1, 2, 3, 4], hits=[1, 1, 3])
    assert list(o) == [2, 4, 3, 1] == _drain(o)
    _fill(o, [1, 2])  # on_take reset every count: plain release order again
    assert _drain(o) == [1, 2]


def test_slru_probation_first_protected_bounded():
    o = make_order("slru:protected=0.25", 8, _Index(), 16)  # protected holds 2
    _fill(o, [1, 2, 3, 4, 5], hits=[1, 2, 3])
    assert len(o.protected) == 2 and 1 in o.probation  # 1 overflowed back to probation
    assert list(o) == [1, 4, 5, 2, 3] == _drain(o)  # 1 dropped back before 4, 5 came


def test_cost_aware_frequency_times_prefix_length_squared():
    o = _order("cost")
    _fill(o, [3, 2, 1], hits=[1] * 9)  # block 1: 10 x 16**2; 2: 1 x 32**2; 3: 1 x 48**2
    assert _drain(o) == [2, 3, 1]  # 1024 < 2304 < 2560
    o = make_order("cost:alpha=0", 8, _Index(), 16)  # cost ignored: LFU
    _fill(o, [3, 2, 1], hits=[1])
    assert _drain(o) == [3, 2, 1]


def test_arc_recency_then_frequency_and_ghosts_move_the_target():
    o = _order("arc")
    _fill(o, [1, 2, 3, 4], hits=[1])  # t1 (no hit): 2, 3, 4; t2: 1; target p = 0
    assert list(o) == [2, 3, 4, 1]
    assert o.evict_one() == (2, "d2")  # t1 above its target: its least recent goes, ghost d2
    o.on_take([5])
    o[5] = "d2"  # d2's content recomputed: a ghost of t1, so t1 deserved room (p 0 -> 1)
    assert o.p == 1 and 5 in o.t2 and "d2" not in o.b1
    assert list(o) == [3, 1, 5, 4]  # t1 trimmed to p first, then t2, then the rest of t1
    out = []
    while o:
        out.append(o.evict_one())
    assert out == [(3, "d3"), (1, "d1"), (5, "d2"), (4, "d4")]
    o.on_take([6])
    o[6] = "d1"  # a ghost of t2: the target shrinks back
    assert o.p == 0 and 6 in o.t2
    for i in range(20):  # ghosts stay bounded by the pool's size
        o.on_take([7])
        o[7] = f"x{i}"
        assert o.evict_one() == (7, f"x{i}")  # alone in t1, above p = 0
    assert len(o.b1) <= 8 and len(o.b2) <= 8


def test_waiting_aware_protects_the_head_of_the_queue():
    o = _order("waiting")
    _fill(o, [1, 2, 3])
    o.protect([1, 3])
    assert o.evict_one()[0] == 2
    assert o.evict_one()[0] == 1  # only protected blocks left: LRU among them


def test_tail_first_never_cuts_a_chain():
    o = _order("tail_first")
    _fill(o, [1, 4, 2, 6, 3, 5])  # heads released first (a hit that revived heads only)
    assert _drain(o) == [6, 3, 2, 1, 5, 4]
    lru = _order("lru")
    _fill(lru, [1, 4, 2, 6, 3, 5])
    assert _drain(lru) == [1, 4, 2, 6, 3, 5]


def test_priority_lowest_first_and_retention_expires_exactly():
    o = _order("priority")
    o.on_take(range(8))
    o.retain([1], 90, None)
    o.retain([2], 10, None)
    o.retain([3], 90, 5.0)
    _fill_no_take(o, [1, 2, 3, 4])
    assert list(o) == [2, 4, 1, 3]
    o.advance(4.999)
    assert list(o) == [2, 4, 1, 3]
    o.advance(5.0)  # 3's retention ended: default priority, its release order kept
    assert list(o) == [2, 3, 4, 1] == _drain(o)


def _fill_no_take(order, blocks):
    for b in blocks:
        order[b] = f"d{b}"


def _cycle(policy, retain_a=None, now=None):
    """a and b (2 full blocks each, and a partial one) computed and freed, a first; d then
    takes the two free blocks and evicts two cached ones. Returns the prompt tokens a's re-run
    finds cached."""
    bm = BlockManager(7, 2, prefix_eviction=policy, debug=True)
    for sid, toks in (("a", [1, 2, 3, 4, 0]), ("b", [5, 6, 7, 8, 0])):
        bm.allocate(sid, toks)
        bm.mark_computed(sid, 4)
        if sid == "a" and retain_a is not None:
            bm.set_retention("a", *retain_a)
        bm.free(sid)
    if now is not None:
        bm.set_time(now)
    assert bm.allocate("d", [9] * 8) == 0
    bm.free("d")
    return bm.allocate("a2", [1, 2, 3, 4, 0]), bm


def test_priority_and_retention_through_the_block_manager():
    assert _cycle("lru")[0] == 0  # a released first: evicted
    assert _cycle("priority", (90, None))[0] == 4  # kept over b
    assert _cycle("priority", (90, 10.0), now=9.9)[0] == 4
    assert _cycle("priority", (90, 10.0), now=10.0)[0] == 0  # retention over: LRU again
    assert _cycle("priority", (20, None))[0] == 0
    assert _cycle("lfu", (90, None))[0] == 0  # other policies ignore retention
    with pytest.raises(ValueError, match="priority"):
        _cycle("priority", (101, None))


def test_sampling_params_and_server_body_carry_priority():
    from paged.server.protocol import CompletionRequest, sampling_params
    req = CompletionRequest(prompt="x", cache_priority=80, cache_retention_s=2.5)
    p = sampling_params(req, 4, logprobs=None)
    assert (p.cache_priority, p.cache_retention_s) == (80, 2.5)
    with pytest.raises(ValueError, match="cache_retention_s"):
        SamplingParams(cache_retention_s=1.0)
    with pytest.raises(ValueError, match="cache_priority"):
        SamplingParams(cache_priority=101)


@pytest.mark.parametrize("spec,match", [
    ("fifo", "unknown policy 'fifo'"), ("slru:protect=0.5", "bad parameter"),
    ("slru:protected=2", r"must be in \[0.0, 1.0\]"), ("waiting:lookahead=x", "not an int"),
    ("lfu:", "empty parameter"), (3, "must be a str")])
def test_bad_names_and_parameters_are_one_clear_error(spec, match):
    for build in (lambda: EngineConfig(prefix_eviction=spec),
                  lambda: BlockManager(4, 2, prefix_eviction=spec)):
        with pytest.raises((ValueError, TypeError), match=match):
            build()


def test_refused_pairs_name_both_settings():
    with pytest.raises(ValueError, match="prefix_eviction \\+ no_prefix_caching"):
        EngineConfig(prefix_eviction="lfu", enable_prefix_caching=False)


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_host_tier_under_every_policy(policy):
    rng = random.Random(1)
    bm = BlockManager(9, 2, num_host_tier_blocks=3, debug=True, prefix_eviction=policy)
    prefixes = [[100 + i] * 4 for i in range(6)]
    live: list[str] = []
    for i in range(150):
        if live and (len(live) > 2 or rng.random() < 0.4):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
            if bm.allocate(f"s{i}", tokens) is not None:
                live.append(f"s{i}")
        step = bm.begin_step()
        bm.take_tier_copies()
        bm.step_completed(step)
        for sid in live:
            if not bm.is_loading(sid):
                bm.mark_computed(sid, bm.num_tokens(sid))
    assert bm.host_tier_stats()["hits"] > 0 and bm.eviction_policy == policy


class _PolicyMachine(BlockManagerMachine):
    """The stateful machine, plus now and then the policy's feeds (retention, clock, the
    waiting queue's protection)."""

    now = 0.0

    @rule(data=st.data())
    def step(self, data):
        if data.draw(st.integers(0, 7), label="feed") == 0:
            sid = self._seq_ids(data, lambda s: not self.bm.is_swapped(s))
            if sid is not None:
                until = data.draw(st.sampled_from([None, self.now + 1.0]), label="until")
                self.bm.set_retention(sid, data.draw(st.integers(0, 100)), until)
            self.now += data.draw(st.sampled_from([0.0, 0.5, 2.0]), label="dt")
            feed = self.bm.eviction_feed
            if feed is not None:
                feed(self.now, [])
            self.bm.protect_waiting([(list(base[:9]), None) for base in
                                     data.draw(st.lists(st.sampled_from(_BASES_FOR_FEED),
                                                        max_size=2), label="waiting")])
            self.bm.check_invariants()
            return
        super().step(data)


_BASES_FOR_FEED = ((0, 1, 0, 1, 2, 0, 1, 0, 2), (2, 0, 1, 0, 2, 0, 1, 0, 2))


@pytest.mark.parametrize("policy", sorted(set(EVICTION_POLICIES) - {"lru"}))
def test_stateful_block_manager_under_every_policy(policy):
    machine = type(f"Machine_{policy}", (_PolicyMachine,), {"EVICTION": policy})
    assert _run(machine, 6, 150) >= 600
