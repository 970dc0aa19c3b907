"""Scenarios for `paged.kv.block_manager`: refcounts, content versions, LRU order, no-reuse window.

Block size 4 throughout unless a test says otherwise; prompts are small ints so the expected tables
can be written by hand.
"""

from __future__ import annotations

import pytest

from paged.kv.block_manager import BlockManager
from paged.kv.paging import NULL_PAGE

B = 4


def make(num_blocks=32, **kw) -> BlockManager:
    kw.setdefault("debug", True)
    return BlockManager(num_blocks, B, **kw)


def snapshot(bm: BlockManager):
    """Everything a failed call must leave untouched."""
    seqs = {}
    for sid in bm.seq_ids():
        swapped = bm.is_swapped(sid)
        table = bm.host_block_table(sid) if swapped else bm.block_table(sid)
        seqs[sid] = (swapped, table, bm.num_tokens(sid), bm.num_computed_tokens(sid))
    blocks = [(bm.block_state(b), bm.refcount(b), bm.block_version(b), bm.block_key(b))
              for b in range(bm.num_blocks)]
    return (bm.stats() | {"failed_allocations": None}, seqs, blocks, bm.evictable_blocks(),
            list(bm._pool.free), bm.last_begun_step, bm.last_completed_step)


def prefill(bm, sid, tokens, **kw):
    """Allocate and run the prompt (one synchronous step); returns the cached token count."""
    hit = bm.allocate(sid, tokens, **kw)
    assert hit is not None
    bm.step_completed(bm.begin_step())
    bm.mark_computed(sid, len(tokens))
    return hit


# --- allocation and the prefix cache --------------------------------------------------------------
def test_miss_then_hit_on_the_same_chain_shares_blocks_with_refcount_2():
    bm = make()
    prompt = list(range(13))  # 3 full blocks + 1 token
    assert prefill(bm, "a", prompt) == 0
    assert bm.stats()["misses"] == 3 and bm.stats()["hits"] == 0
    assert bm.allocate("b", prompt) == 12
    ta, tb = bm.block_table("a"), bm.block_table("b")
    assert ta[:3] == tb[:3] and ta[3] != tb[3]
    assert [bm.refcount(b) for b in ta] == [2, 2, 2, 1]
    assert bm.refcount(tb[3]) == 1
    st = bm.stats()
    assert (st["hits"], st["hit_tokens"], st["query_tokens"]) == (3, 12, 26)
    assert bm.num_computed_tokens("b") == 12


def test_final_prompt_token_is_never_served_from_cache():
    bm = make()
    prompt = list(range(8))  # exactly 2 full blocks
    prefill(bm, "a", prompt)
    assert bm.allocate("b", prompt) == 4  # block 1 holds the final token: recomputed
    assert bm.block_table("b")[0] == bm.block_table("a")[0]
    assert bm.block_table("b")[1] != bm.block_table("a")[1]


def test_a_block_is_keyed_only_once_full_and_computed():
    bm = make()
    bm.allocate("a", [1, 2, 3, 4, 5, 6])
    b0, b1 = bm.block_table("a")
    assert bm.block_key(b0) is None  # full but not computed
    assert bm.allocate("x", [1, 2, 3, 4, 5, 6]) == 0  # nothing served before its KV was written
    bm.free("x")
    bm.mark_computed("a", 3)
    assert bm.block_key(b0) is None  # computed but not full
    bm.mark_computed("a", 6)
    assert bm.block_key(b0) is not None and bm.block_key(b1) is None  # b1 is partial
    bm.append_slots("a", [7, 8])
    assert bm.block_key(b1) is None  # full, not computed
    bm.mark_computed("a", 7)
    assert bm.block_key(b1) is None
    bm.mark_computed("a", 8)
    assert bm.block_key(b1).prefix_token_ids() == (1, 2, 3, 4, 5, 6, 7, 8)
    # Decode blocks are reusable, e.g. by a multi-turn follow-up.
    assert bm.allocate("follow-up", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_hit_verifies_the_parent_chain_even_when_every_hash_collides():
    bm = make(hash_fn=lambda parent, ids, salt: 0)  # every key lands in one bucket
    x, y, z, w = [1] * B, [2] * B, [3] * B, [4] * B
    prefill(bm, "xy", x + y + [0])
    prefill(bm, "zw", z + w + [0])
    # Block 1 of this prompt has the tokens of a cached block (y) but a different parent (z).
    assert bm.allocate("zy", z + y + [0]) == B
    assert bm.block_table("zy")[0] == bm.block_table("zw")[0]
    assert bm.block_table("zy")[1] not in bm.block_table("xy") + bm.block_table("zw")
    assert bm.allocate("xy2", x + y + [0]) == 2 * B  # the right chain still hits
    assert bm.block_table("xy2")[:2] == bm.block_table("xy")[:2]
    assert bm.allocate("yy", y + y + [0]) == 0


@pytest.mark.parametrize("hash_fn", [None, lambda parent, ids, salt: ids[0]])  # weak: ignores salt
def test_salt_isolation(hash_fn):
    bm = make(cache_salt="model-a|w1|f32", hash_fn=hash_fn)
    prompt = list(range(9))
    prefill(bm, "a", prompt)
    assert bm.allocate("adapter", prompt, cache_salt="model-a|w1|f32|lora-7") == 0
    assert bm.allocate("same", prompt) == 8
    other = make(cache_salt=b"model-a|w2|f32")
    prefill(other, "a", prompt)
    assert other.allocate("b", prompt, cache_salt="model-a|w1|f32") == 0


def test_null_page_is_never_handed_out_and_the_pool_is_used_exactly():
    bm = make(num_blocks=9, enable_prefix_caching=False)
    assert bm.allocate("a", list(range(8 * B))) == 0
    assert sorted(bm.block_table("a")) == list(range(1, 9))
    assert NULL_PAGE not in bm.block_table("a")
    assert bm.num_allocatable_blocks == 0
    assert bm.allocate("b", [1]) is None


def test_failed_allocation_changes_nothing():
    bm = make(num_blocks=8)  # 7 usable
    prefill(bm, "a", list(range(9)))  # blocks 2 keyed + 1
    bm.allocate("b", [100, 101, 102, 103, 104])  # 2 blocks
    bm.free("a")  # 2 cached + 1 free
    before = snapshot(bm)
    assert not bm.can_allocate(list(range(100, 100 + 7 * B)))
    assert bm.allocate("c", list(range(100, 100 + 7 * B))) is None
    assert bm.append_slots("b", list(range(6 * B))) is None
    assert bm.reserve_lookahead("b", 6 * B) is None
    assert bm.num_slots_needed("b", 6 * B) == 6 > bm.num_allocatable_blocks
    assert snapshot(bm) == before
    assert bm.stats()["failed_allocations"] == 1


def test_lru_eviction_order_after_frees():
    bm = make(num_blocks=10)  # 9 usable
    prefill(bm, "a", list(range(13)))  # a0 a1 a2 keyed + a3
    prefill(bm, "b", list(range(50, 59)))  # b0 b1 keyed + b2
    ta, tb = bm.block_table("a"), bm.block_table("b")
    bm.free("a")
    bm.free("b")
    # Tail blocks before head blocks, earlier frees before later ones.
    assert bm.evictable_blocks() == [ta[2], ta[1], ta[0], tb[1], tb[0]]
    assert bm.num_free_blocks == 4  # 2 unkeyed tails + 2 never used
    # Nine fresh blocks: four free ones, then evictions in exactly that order.
    evicted = []
    bm._pool.on_free = evicted.extend
    assert bm.allocate("c", list(range(100, 100 + 6 * B + 1))) == 0
    assert evicted == [ta[2], ta[1], ta[0]]
    assert bm.stats()["evictions"] == 3
    assert bm.evictable_blocks() == [tb[1], tb[0]]
    bm.free("c")
    assert bm.allocate("b2", list(range(50, 59))) == 8  # b's chain survived


def test_a_hit_revives_a_freed_cached_block_and_refreshes_its_recency():
    bm = make(num_blocks=10)
    prefill(bm, "a", list(range(9)))
    prefill(bm, "b", list(range(50, 59)))
    ta, tb = bm.block_table("a"), bm.block_table("b")
    bm.free("a")
    bm.free("b")
    assert bm.evictable_blocks() == [ta[1], ta[0], tb[1], tb[0]]
    assert bm.block_state(ta[0]) == "cached"
    assert bm.allocate("a2", list(range(9))) == 8
    assert bm.block_table("a2")[:2] == ta[:2]
    assert [bm.block_state(b) for b in ta[:2]] == ["used", "used"]
    assert [bm.refcount(b) for b in ta[:2]] == [1, 1]
    assert bm.stats()["revived"] == 2 and bm.num_cached_blocks == 2
    bm.free("a2")
    assert bm.evictable_blocks() == [tb[1], tb[0], ta[1], ta[0]]  # a's blocks are now the newest


def _two_freed_chains():
    bm = make(num_blocks=7)  # 6 usable
    prefill(bm, "a", list(range(9)))  # a0 a1 keyed, a2 partial
    prefill(bm, "b", list(range(50, 59)))  # b0 b1 keyed, b2 partial
    ta, tb = bm.block_table("a"), bm.block_table("b")
    bm.free("a")
    bm.free("b")
    assert bm.evictable_blocks() == [ta[1], ta[0], tb[1], tb[0]]  # a's blocks are evicted first
    assert bm.num_free_blocks == 2 and bm.num_allocatable_blocks == 6
    return bm, ta, tb


def test_an_allocation_never_evicts_the_blocks_it_is_about_to_hit():
    bm, ta, tb = _two_freed_chains()
    prompt = list(range(8)) + list(range(200, 200 + 3 * B + 1))  # hits a0 a1, 4 fresh blocks
    assert bm.can_allocate(prompt)
    assert bm.allocate("c", prompt) == 8
    table = bm.block_table("c")
    assert table[:2] == ta[:2]  # the oldest LRU entries were hit, not evicted
    assert set(tb[:2]) <= set(table[2:])  # b's cached blocks were evicted instead
    assert bm.stats()["evictions"] == 2


def test_hit_blocks_do_not_count_as_capacity_for_the_rest_of_the_prompt():
    bm, ta, tb = _two_freed_chains()
    prompt = list(range(8)) + list(range(200, 200 + 4 * B + 1))  # 2 hits + 5 fresh > 6 - 2
    before = snapshot(bm)
    assert not bm.can_allocate(prompt)
    assert bm.allocate("c", prompt) is None
    assert snapshot(bm) == before


# --- copy-on-write, lookahead, rollback -----------------------------------------------------------
@pytest.mark.parametrize("debug", [True, False])  # debug=False takes the decode fast path
@pytest.mark.parametrize("writer,other", [("parent", "child"), ("child", "parent")])
def test_cow_on_fork_then_append_on_either_side(writer, other, debug):
    if True:
        bm = make(debug=debug)
        prefill(bm, "parent", list(range(6)))
        bm.fork("parent", "child")
        t = bm.block_table("parent")
        assert bm.block_table("child") == t and [bm.refcount(b) for b in t] == [2, 2]
        pairs = bm.append_slots(writer, [6])
        assert len(pairs) == 1
        src, dst = pairs[0]
        assert src == t[1] and dst not in t
        assert bm.block_table(writer) == [t[0], dst]
        assert bm.block_table(other) == t
        assert (bm.refcount(t[0]), bm.refcount(t[1]), bm.refcount(dst)) == (2, 1, 1)
        assert bm.append_slots(other, [9]) == []  # sole owner now: in place
        assert bm.append_slots(writer, [7]) == []
        assert bm.stats()["cow_copies"] == 1


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = make()
    prefill(bm, "p", list(range(8)))
    bm.fork("p", "c")
    assert bm.append_slots("c", [8]) == []
    assert bm.block_table("c")[:2] == bm.block_table("p")
    assert bm.stats()["cow_copies"] == 0


@pytest.mark.parametrize("debug", [True, False])
def test_rollback_after_rejected_lookahead_slots(debug):
    bm = make(debug=debug)
    prefill(bm, "s", list(range(6)))
    t = bm.block_table("s")
    assert bm.reserve_lookahead("s", 5, [6, 7, 8, 9, 10]) == []
    assert bm.num_tokens("s") == 11 and len(bm.block_table("s")) == 3
    extra = bm.block_table("s")[2]
    bm.step_completed(bm.begin_step())
    bm.mark_computed("s", 11)  # the verify step wrote all drafts
    v = bm.block_version(t[1])
    bm.rollback("s", 4)  # 1 draft accepted
    assert bm.num_tokens("s") == 7 and bm.num_computed_tokens("s") == 7
    assert bm.block_table("s") == t and bm.block_state(extra) == "free"
    assert bm.block_key(t[1]) is not None  # keyed when the drafts filled it; content still intact
    bm.append_slots("s", [42])  # rewrites a rolled-back slot: the key dies, new content version
    assert bm.block_key(t[1]) is None and bm.block_version(t[1]) == v + 1
    assert bm.allocate("probe", list(range(9))) == 4  # block 1 (4 5 6 7) is no longer served
    with pytest.raises(ValueError):
        bm.rollback("s", 9)


@pytest.mark.parametrize("debug", [True, False])
def test_rollback_into_a_cached_block_rewrites_it_only_after_copy_or_uncaching(debug):
    bm = make(debug=debug)
    prefill(bm, "a", list(range(9)))
    a0, a1, _ = bm.block_table("a")
    v1 = bm.block_version(a1)
    bm.rollback("a", 3)  # now 6 tokens; a1 keyed but partial for "a"
    assert bm.block_key(a1) is not None  # content intact until rewritten
    assert bm.allocate("b", list(range(9))) == 8  # still served: nothing rewrote it
    bm.free("b")
    bm.append_slots("a", [99])  # sole owner rewrites slot 6: the key dies, the version changes
    assert bm.block_key(a1) is None and bm.block_version(a1) == v1 + 1
    assert bm.allocate("c", list(range(9))) == 4
    # Shared instead: the writer copies.
    bm2 = make(debug=debug)
    prefill(bm2, "a", list(range(9)))
    t = bm2.block_table("a")
    assert bm2.allocate("b", list(range(9))) == 8
    bm2.rollback("a", 3)
    (pair,) = bm2.append_slots("a", [99])
    assert pair[0] == t[1] and bm2.block_key(t[1]) is not None
    assert bm2.block_table("b")[:2] == t[:2]


# --- quarantine -----------------------------------------------------------------------------------
def test_freed_block_is_not_reused_inside_the_quarantine_window():
    bm = make(num_blocks=5)  # 4 usable
    bm.allocate("a", list(range(2 * B)))
    bm.allocate("b", list(range(100, 100 + 2 * B)))
    ta = bm.block_table("a")
    step = bm.begin_step()  # a step reading a's blocks is in flight
    bm.free("a")
    assert bm.num_quarantined_blocks == 2 and bm.num_allocatable_blocks == 0
    assert [bm.block_state(b) for b in ta] == ["quarantined"] * 2
    assert bm.allocate("c", [1]) is None
    assert bm.append_slots("b", [1]) is None
    bm.step_completed(step)
    assert bm.num_quarantined_blocks == 0 and bm.num_free_blocks == 2
    assert bm.allocate("c", [1]) == 0 and bm.block_table("c")[0] in ta
    assert bm.stats()["quarantined"] == 2


@pytest.mark.parametrize("quarantine_steps", [0, 1, 2, 3])
def test_quarantine_window_length(quarantine_steps):
    bm = make(num_blocks=3, quarantine_steps=quarantine_steps)  # 2 usable
    bm.allocate("keep", [1])
    bm.allocate("a", [1])
    s = bm.begin_step()
    bm.free("a")
    reusable_after = []
    for k in range(4):
        reusable_after.append(bm.num_free_blocks)
        bm.step_completed(s + k)
        bm.begin_step()
    expected = {0: [1, 1, 1, 1], 1: [0, 1, 1, 1], 2: [0, 0, 1, 1], 3: [0, 0, 0, 1]}
    assert reusable_after == expected[quarantine_steps]


def test_no_step_in_flight_means_immediate_reuse_and_completion_is_cumulative():
    bm = make(num_blocks=4)
    bm.allocate("a", [1])
    bm.step_completed(bm.begin_step())
    bm.free("a")
    assert bm.num_free_blocks == 3
    bm.allocate("b", [1])
    s0, s1 = bm.begin_step(), bm.begin_step()  # two steps in flight
    bm.free("b")
    bm.step_completed(s0)
    assert bm.num_quarantined_blocks == 1  # s1 may still read it
    bm.step_completed(s1)
    bm.step_completed(s0)  # idempotent
    assert bm.num_quarantined_blocks == 0
    with pytest.raises(ValueError):
        bm.step_completed(s1 + 1)


def test_quarantined_cached_block_goes_to_the_lru_and_a_hit_may_revive_it():
    bm = make()
    prefill(bm, "a", list(range(9)))
    a0, a1, a2 = bm.block_table("a")
    s = bm.begin_step()
    bm.free("a")
    assert [bm.block_state(b) for b in (a0, a1, a2)] == ["quarantined"] * 3
    assert bm.allocate("b", list(range(9))) == 8  # reading intact content is safe
    assert bm.block_state(a0) == "used" and bm.num_quarantined_blocks == 1
    bm.step_completed(s)
    assert bm.block_state(a2) == "free" and bm.refcount(a0) == 1
    bm.free("b")
    assert bm.evictable_blocks()[-2:] == [a1, a0]


def test_copy_sources_and_destinations_are_held_until_their_step_completes():
    bm = make(num_blocks=6)
    prefill(bm, "p", list(range(6)))
    bm.fork("p", "c")
    ((src, dst),) = bm.append_slots("c", [6])
    bm.free("p")
    bm.free("c")  # both ends of the pending copy lose their last reference before the copy ran
    assert bm.block_state(src) == bm.block_state(dst) == "quarantined"
    freed = []
    bm._pool.on_free = freed.extend
    s = bm.begin_step()  # this step performs the copy
    bm.step_completed(s)
    assert {src, dst} <= set(freed)


def test_on_free_reports_blocks_whose_content_died():
    freed = []
    bm = make(on_free=freed.extend)
    prefill(bm, "a", list(range(9)))
    t = bm.block_table("a")
    bm.free("a")
    assert freed == [t[2]]  # a0, a1 stay cached
    bm.evict_cached(1)
    assert freed == [t[2], t[1]]  # the tail is evicted first
    s = bm.begin_step()
    bm.allocate("b", [5, 6])
    bm.free("b")
    assert len(freed) == 2  # quarantined: not reported yet
    bm.step_completed(s)
    assert len(freed) == 3


# --- swap -----------------------------------------------------------------------------------------
def test_swap_out_and_back_in():
    bm = make(num_blocks=8, num_host_blocks=4)
    prefill(bm, "s", list(range(10)))
    t = bm.block_table("s")
    pairs = bm.swap_out("s")
    assert [p for p, _ in pairs] == t and sorted(h for _, h in pairs) == [0, 1, 2]
    assert bm.is_swapped("s") and bm.num_free_host_blocks == 1
    assert all(bm.block_state(b) == "quarantined" for b in t[2:])  # read by the coming step
    with pytest.raises(ValueError):
        bm.block_table("s")
    with pytest.raises(ValueError):
        bm.append_slots("s", [1])
    s = bm.begin_step()  # performs the swap-out copy
    bm.step_completed(s)
    assert bm.num_tokens("s") == 10 and bm.num_computed_tokens("s") == 10
    assert bm.can_swap_in("s")
    back = bm.swap_in("s")
    assert [h for h, _ in back] == [h for _, h in pairs]
    assert bm.block_table("s") == [p for _, p in back]
    assert bm.num_free_host_blocks == 1  # host slots held until the swap-in copy ran
    bm.step_completed(bm.begin_step())
    assert bm.num_free_host_blocks == 4
    bm.mark_computed("s", 10)  # re-keys its full blocks (deduplicated against the cache)
    bm.append_slots("s", [10])
    assert bm.stats()["swapped_out_blocks"] == bm.stats()["swapped_in_blocks"] == 3


def test_blocks_are_keyed_only_after_their_swap_in_copy_ran():
    bm = make(num_host_blocks=4)
    prefill(bm, "s", list(range(9)))
    bm.swap_out("s")
    bm.step_completed(bm.begin_step())
    bm.swap_in("s")
    t = bm.block_table("s")
    bm.mark_computed("s", 9)  # too early: the pages are filled by the coming step
    assert bm.block_key(t[0]) is None
    bm.step_completed(bm.begin_step())
    bm.mark_computed("s", 9)
    assert bm.block_key(t[0]) is None  # an equal key is still indexed (the swapped-out copy)
    bm.evict_cached()
    bm.mark_computed("s", 9)
    assert bm.block_key(t[0]) is None  # already keyed (with the adopted key): not re-indexed
    bm2 = make(num_host_blocks=4)
    prefill(bm2, "s", list(range(9)))
    bm2.swap_out("s")
    bm2.step_completed(bm2.begin_step())
    bm2.evict_cached()  # the device copy of the prefix is gone
    bm2.swap_in("s")
    t = bm2.block_table("s")
    bm2.mark_computed("s", 9)
    assert bm2.block_key(t[0]) is None  # its swap-in copy has not run
    bm2.step_completed(bm2.begin_step())
    bm2.mark_computed("s", 9)
    assert bm2.block_key(t[0]) is not None and bm2.block_key(t[1]) is not None
    assert bm2.allocate("again", list(range(9))) == 8


def test_swap_fails_cleanly_and_misuse_raises():
    bm = make(num_blocks=6, num_host_blocks=2)
    bm.allocate("s", list(range(10)))  # 3 blocks > 2 host slots
    before = snapshot(bm)
    assert bm.swap_out("s") is None
    assert snapshot(bm) == before
    bm.allocate("t", [1])
    assert bm.swap_out("t") is not None
    bm.step_completed(bm.begin_step())
    assert bm.allocate("u", list(range(2 * B))) == 0  # fill the pool
    assert not bm.can_swap_in("t")
    before = snapshot(bm)
    assert bm.swap_in("t") is None
    assert snapshot(bm) == before
    with pytest.raises(ValueError):
        bm.swap_in("s")
    bm.free("u")
    bm.swap_in("t")
    assert bm.swap_out("t") is None  # its swap-in copy has not run yet
    bm.step_completed(bm.begin_step())
    assert bm.swap_out("t") is not None
    assert not bm.can_swap_in("t") and bm.swap_in("t") is None  # nor has its swap-out copy
    bm.step_completed(bm.begin_step())
    assert bm.swap_in("t") is not None


def test_swap_out_of_a_fresh_cow_destination_reads_the_source():
    bm = make(num_host_blocks=4)
    prefill(bm, "p", list(range(6)))
    bm.fork("p", "c")
    ((src, dst),) = bm.append_slots("c", [6])
    pairs = bm.swap_out("c")
    assert [p for p, _ in pairs] == [bm.block_table("p")[0], src]


# --- misuse ---------------------------------------------------------------------------------------
def test_misuse_raises_value_error_before_any_state_change():
    bm = make(num_blocks=16, num_host_blocks=2)
    prefill(bm, "a", list(range(6)))
    bm.append_slots("a", [6])  # one slot not computed yet
    before = snapshot(bm)
    bad = [
        lambda: bm.allocate("a", [1]),  # duplicate id
        lambda: bm.allocate("n", []),
        lambda: bm.allocate("n", [1, -2]),
        lambda: bm.allocate("n", [1, "x"]),
        lambda: bm.allocate("n", [1, 2**63]),
        lambda: bm.allocate("n", 5),
        lambda: bm.allocate("n", [1], cache_salt=3),
        lambda: bm.can_allocate([]),
        lambda: bm.append_slots("zz", [1]),
        lambda: bm.append_slots("a", [1, 2.5]),
        lambda: bm.append_slots("a", [None, -1]),  # None (unknown) is allowed, -1 is not
        lambda: bm.reserve_lookahead("a", -1),
        lambda: bm.reserve_lookahead("a", 2, [1]),
        lambda: bm.rollback("a", 8),
        lambda: bm.rollback("a", -1),
        lambda: bm.mark_computed("a", 5),  # decreases
        lambda: bm.mark_computed("a", 8),  # beyond the slots
        lambda: bm.mark_computed("zz", 1),
        lambda: bm.fork("a", "b"),  # a slot is not computed yet
        lambda: bm.fork("zz", "b"),
        lambda: bm.free("zz"),
        lambda: bm.block_table("zz"),
        lambda: bm.num_tokens("zz"),
        lambda: bm.num_slots_needed("a", -1),
        lambda: bm.swap_in("a"),
        lambda: bm.can_swap_in("a"),
        lambda: bm.host_block_table("a"),
        lambda: bm.step_completed(99),
        lambda: bm.step_completed(-1),
        lambda: bm.evict_cached(-1),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
        assert snapshot(bm) == before
    bm.step_completed(bm.begin_step())
    bm.mark_computed("a", 7)
    bm.fork("a", "b")
    with pytest.raises(ValueError):
        bm.fork("a", "b")  # b exists


@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=1, block_size=4), dict(num_blocks=8, block_size=0),
    dict(num_blocks=8, block_size=4, quarantine_steps=-1),
    dict(num_blocks=8, block_size=4, num_host_blocks=-1),
    dict(num_blocks=8, block_size=4, cache_salt=1.5),
    dict(num_blocks=8, block_size=4, hash_fn=3), dict(num_blocks=8, block_size=4, on_free=3),
])
def test_constructor_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        BlockManager(**kwargs)


# --- accounting -----------------------------------------------------------------------------------
def test_block_usage_counts_shared_blocks_once_and_peak_usage():
    bm = make()
    prefill(bm, "a", list(range(6)))
    bm.fork("a", "b")
    bm.append_slots("b", [6])  # CoW: b has its own tail with 3 slots
    usage = bm.block_usage()
    assert sorted(usage) == sorted([(2, 4), (1, 2), (1, 3)])
    assert bm.stats()["peak_used_blocks"] == 3
    bm.free("a")
    bm.free("b")
    assert bm.block_usage() == [] and bm.stats()["peak_used_blocks"] == 3
    total = bm.num_free_blocks + bm.num_cached_blocks + bm.num_used_blocks
    assert total + bm.num_quarantined_blocks == bm.num_blocks - 1


def test_invariant_checker_catches_corruption():
    bm = make(debug=False)
    prefill(bm, "a", list(range(9)))
    bm._pool.rc[bm.block_table("a")[0]] += 1
    with pytest.raises(AssertionError, match="refcount"):
        bm.check_invariants()
    bm = make(debug=False)
    prefill(bm, "a", list(range(9)))
    bm._pool.version[bm.block_table("a")[0]] += 1  # rewritten behind the cache's back
    with pytest.raises(AssertionError, match="stale"):
        bm.check_invariants()
    bm = make(debug=False)
    prefill(bm, "a", list(range(9)))
    bm._pool.free.append(bm.block_table("a")[2])
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm = make(debug=False)
    prefill(bm, "a", list(range(9)))
    bm.free("a")
    bm._pool.lru[bm.evictable_blocks()[0]] = b"not its digest"
    with pytest.raises(AssertionError, match="digest"):
        bm.check_invariants()
    bm = make(debug=False)
    prefill(bm, "a", list(range(9)))
    bm._fence.busy_until[bm.block_table("a")[0]] = bm.last_begun_step + 1  # a copy nobody recorded
    with pytest.raises(AssertionError, match="latest copy step"):
        bm.check_invariants()


# --- batched decode calls -------------------------------------------------------------------------
@pytest.mark.parametrize("debug", [True, False])
def test_append_decode_slots_matches_per_sequence_calls(debug):
    bm = make(debug=debug)
    prefill(bm, "p", list(range(6)))
    bm.fork("p", "c")  # both share the partial tail: only the first writer copies
    prefill(bm, "q", list(range(100, 108)))  # tail full: takes a fresh block
    tail = bm.block_table("p")[1]
    pairs = bm.append_decode_slots(["p", "c", "q"], [6, 60, 108])
    assert len(pairs) == 1 and pairs[0][0] == tail
    assert bm.block_table("c")[1] == tail and bm.refcount(tail) == 1
    assert bm.block_table("p")[1] == pairs[0][1]
    assert [bm.num_tokens(s) for s in ("p", "c", "q")] == [7, 7, 9]
    bm.step_completed(bm.begin_step())
    bm.mark_computed_many(["p", "c", "q"], [7, 7, 9])
    assert [bm.num_computed_tokens(s) for s in ("p", "c", "q")] == [7, 7, 9]
    assert bm.block_key(bm.block_table("q")[1]) is not None


@pytest.mark.parametrize("debug", [True, False])  # debug=False takes the one-pass fast path
def test_batched_calls_are_all_or_nothing(debug):
    bm = make(num_blocks=5, debug=debug)  # 4 usable
    prefill(bm, "a", list(range(4)))
    prefill(bm, "b", list(range(10, 14)))
    bm.allocate("c", [1])
    before = snapshot(bm)
    assert bm.append_decode_slots(["a", "b", "c"], [1, 2, 3]) is None  # needs 2 blocks, 1 free
    assert snapshot(bm) == before
    bad_calls = ([["a", "a"], [1, 2]], [["a", "zz"], [1, 2]], [["a", "b"], [1]],
                 [["a", "b"], [1, -1]])
    for bad in bad_calls:
        with pytest.raises(ValueError):
            bm.append_decode_slots(*bad)
        assert snapshot(bm) == before
    for bad in ([["a", "a"], [4, 4]], [["a", "b"], [4, 3]], [["a", "b"], [4, 9]], [["a"], []]):
        with pytest.raises(ValueError):
            bm.mark_computed_many(*bad)
        assert snapshot(bm) == before


def test_append_decode_slots_counts_one_copy_per_extra_sharer():
    bm = make(num_blocks=4)  # 3 usable
    prefill(bm, "p", list(range(6)))  # 2 blocks, tail shared by the forks below
    bm.fork("p", "c")
    assert bm.num_allocatable_blocks == 1
    pairs = bm.append_decode_slots(["p", "c"], [6, 7])  # the second writer keeps the tail
    assert len(pairs) == 1 and bm.num_allocatable_blocks == 0


def _decode_state(bm, sids):
    return ([(bm.block_table(s), bm.num_tokens(s)) for s in sids], bm.num_allocatable_blocks,
            bm.stats()["cow_copies"])


def test_append_decode_slots_fast_pass_is_undone_for_the_general_path():
    """In-place and block-starting sequences ahead of one that needs the general path (a shared
    tail) or of a bad token: the one-pass fast path must leave no trace."""
    twins = [make(debug=False) for _ in range(2)]
    for bm in twins:
        prefill(bm, "a", list(range(5)))  # room 3
        prefill(bm, "b", list(range(20, 28)))  # 2 full blocks: starts a third
        prefill(bm, "p", list(range(40, 46)))
        bm.fork("p", "f")  # shared partial tail: room not known
    batched, per_seq = twins
    sids = ["a", "b", "f", "p"]
    before = snapshot(batched)
    with pytest.raises(ValueError):
        batched.append_decode_slots(sids, [1, 2, 3, 2**63])
    assert snapshot(batched) == before
    pairs = batched.append_decode_slots(sids, [1, 2, 3, 4])
    expected = [pair for s, t in zip(sids, [1, 2, 3, 4]) for pair in per_seq.append_slots(s, [t])]
    assert pairs == expected and len(pairs) == 1
    assert _decode_state(batched, sids) == _decode_state(per_seq, sids)
    batched.check_invariants()
    for bm in twins:
        bm.step_completed(bm.begin_step())
    batched.mark_computed_many(sids, [6, 9, 7, 7])
    for s, n in zip(sids, [6, 9, 7, 7]):
        per_seq.mark_computed(s, n)
    assert [batched.block_key(b) is not None for b in batched.block_table("b")] == [
        True, True, False]
    assert [batched.num_computed_tokens(s) for s in sids] == [6, 9, 7, 7]
    assert batched.stats() == per_seq.stats()


def test_append_decode_slots_fast_pass_is_undone_when_the_pool_runs_short():
    bm = make(num_blocks=5, debug=False)  # 4 usable
    prefill(bm, "a", list(range(4)))  # full tails: each starts a block
    prefill(bm, "b", list(range(10, 14)))
    bm.allocate("c", [1])  # room 3, ahead of nothing: written in place first
    before = snapshot(bm)
    assert bm.append_decode_slots(["c", "a", "b"], [7, 8, 9]) is None  # needs 2, 1 left
    assert snapshot(bm) == before
    bm.check_invariants()
    assert bm.append_decode_slots(["c", "a"], [7, 8]) == []
    assert bm.num_tokens("c") == 2 and bm.num_tokens("a") == 5 and bm.num_allocatable_blocks == 0


def test_append_decode_slots_repeated_batch_follows_frees_and_mutated_ids():
    """A repeated batch skips its id lookups: the shortcut must follow an id that was freed and
    allocated again (a new sequence), and a list of ids changed in place."""
    bm = make(debug=False)
    prefill(bm, "a", list(range(5)))
    prefill(bm, "b", list(range(20, 23)))
    ids = ["a", "b"]
    assert bm.append_decode_slots(ids, [5, 23]) == []
    assert bm.append_decode_slots(ids, [6, 24]) == []  # the same list again
    assert [bm.num_tokens(s) for s in ids] == [7, 5]
    bm.step_completed(bm.begin_step())
    bm.free("b")
    prefill(bm, "b", [1])  # the same id, a new sequence
    assert bm.append_decode_slots(ids, [7, 2]) == []
    assert [bm.num_tokens(s) for s in ids] == [8, 2]
    prefill(bm, "c", [9, 9])
    ids[1] = "c"  # changed in place
    assert bm.append_decode_slots(ids, [8, 3]) == []
    assert [bm.num_tokens(s) for s in ("a", "b", "c")] == [9, 2, 3]
    with pytest.raises(ValueError, match="repeated"):
        bm.append_decode_slots(["a", "a"], [1, 2])
    bm.check_invariants()


def test_mark_computed_many_keys_full_blocks_and_rejects_a_late_bad_count():
    bm = make(debug=False)
    prefill(bm, "a", list(range(3)))
    prefill(bm, "b", list(range(10, 13)))
    bm.append_decode_slots(["a", "b"], [3, 13])  # both tails now full, not computed
    bm.step_completed(bm.begin_step())
    before = snapshot(bm)
    with pytest.raises(ValueError):
        bm.mark_computed_many(["a", "b"], [4, 5])  # b has 4 slots
    assert snapshot(bm) == before
    bm.mark_computed_many(["a", "b"], [4, 4])
    assert [bm.block_key(bm.block_table(s)[0]).token_ids for s in "ab"] == [
        (0, 1, 2, 3), (10, 11, 12, 13)]
    bm.check_invariants()


def test_prefix_index_buckets_collapse_and_a_wrong_digest_is_refused():
    from paged.kv.blocks.prefix_index import PrefixCacheIndex

    index = PrefixCacheIndex(8)
    versions = [0] * 8
    keys = [index.intern(b, None, (b,), b"", 0, versions) for b in (1, 2, 3)]  # one digest
    assert index.buckets == {0: [1, 2, 3]} and len(index) == 3
    assert index.find(0, None, (2,), b"", versions) == 2
    index.remove(2, 0)
    index.remove(1, 0)
    assert index.buckets == {0: 3} and len(index) == 1  # back to a plain block
    with pytest.raises(RuntimeError):
        index.remove(3, 1)
    with pytest.raises(RuntimeError):
        index.remove(4, 0)
    assert index.buckets == {0: 3} and index.key[3] is keys[2]
    index.check(versions)


def test_default_keys_use_the_documented_xxh3_digest():
    import xxhash

    from paged.kv.blocks.prefix_index import xxh3_block_hash

    bm = make(cache_salt=b"m")
    prefill(bm, "a", list(range(9)))
    k0, k1 = (bm.block_key(b) for b in bm.block_table("a")[:2])
    assert k0.digest == xxh3_block_hash(None, (0, 1, 2, 3), b"m")
    assert k1.digest == xxh3_block_hash(k0.digest, (4, 5, 6, 7), b"m")
    # The documented bytes: XXH3-128 of (16 zero bytes | parent digest, int64 LE ids, salt).
    ids = b"".join(t.to_bytes(8, "little") for t in (0, 1, 2, 3))
    assert k0.digest == xxhash.xxh3_128_digest(bytes(16) + ids + b"m") and len(k0.digest) == 16
    assert k0.token_ids == (0, 1, 2, 3) and k1.parent is k0
    assert bm.allocate("b", list(range(9))) == 8  # lookups hash the same way


def test_sha256_stays_an_option_with_the_same_blocks_and_hits():
    import hashlib

    from paged.kv.blocks.prefix_index import sha256_block_hash

    def run(hash_fn):
        bm = make(cache_salt=b"m", hash_fn=hash_fn)
        prefill(bm, "a", list(range(9)))
        bm.free("a")
        hit = bm.allocate("b", list(range(9)) + [5])
        return bm, hit, bm.block_table("b"), bm.evictable_blocks()

    sha, hit, table, lru = run(sha256_block_hash)
    k0 = sha.block_key(table[0])
    ids = b"".join(t.to_bytes(8, "little") for t in (0, 1, 2, 3))
    assert k0.digest == hashlib.sha256(bytes(32) + ids + b"m").digest()
    assert run(None)[1:] == (hit, table, lru) == (8, table, lru)
    sha.check_invariants()


def test_the_default_digest_is_stable_across_processes():
    import os
    import subprocess
    import sys

    code = ("from paged.kv.blocks.prefix_index import xxh3_block_hash as h; "
            "print(h(h(None, (1, 2), b's'), (3, 4), b's').hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env=dict(os.environ, PYTHONHASHSEED=seed)).stdout.strip()
            for seed in ("1", "2")}
    from paged.kv.blocks.prefix_index import xxh3_block_hash as h

    assert outs == {h(h(None, (1, 2), b"s"), (3, 4), b"s").hex()}


# --- token ids not known yet (an overlapped engine step) ------------------------------------------
@pytest.mark.parametrize("debug", [True, False])  # debug=False takes the one-pass decode path
def test_unknown_decode_token_blocks_keying_until_set_tokens_fills_it(debug):
    bm = make(debug=debug)
    prefill(bm, "s", [1, 2, 3])
    assert bm.append_decode_slots(["s"], [None]) == []  # the block is full, its last id unknown
    b0 = bm.block_table("s")[0]
    bm.step_completed(bm.begin_step())
    bm.mark_computed_many(["s"], [4])
    assert bm.block_key(b0) is None  # computed, but not keyed while a token id is unknown
    assert bm.allocate("probe", [1, 2, 3, 7, 9]) == 0
    bm.free("probe")
    assert bm.append_decode_slots(["s"], [8]) == []  # decoding goes on meanwhile
    bm.set_tokens(["s"], [3], [7])  # keyed at once: the block is full and computed
    assert bm.block_key(b0).token_ids == (1, 2, 3, 7)
    assert bm.allocate("probe", [1, 2, 3, 7, 9]) == 4
    assert bm.block_table("probe")[0] == b0
    bm.check_invariants()


@pytest.mark.parametrize("debug", [True, False])
def test_set_tokens_before_the_step_completes_keys_at_mark_computed(debug):
    bm = make(debug=debug)
    prefill(bm, "s", [1, 2, 3])
    bm.append_slots("s", [None])  # one unknown slot, the single-token path
    bm.append_slots("s", [None, 5])  # the general path takes None too
    assert bm.num_tokens("s") == 6
    bm.set_tokens(["s", "s"], [4, 3], [4, 9])  # one sequence, two positions
    b0 = bm.block_table("s")[0]
    assert bm.block_key(b0) is None  # not computed yet
    bm.step_completed(bm.begin_step())
    bm.mark_computed("s", 6)
    assert bm.block_key(b0).token_ids == (1, 2, 3, 9)
    assert bm.allocate("probe", [1, 2, 3, 9, 4]) == 4


def test_set_tokens_validates_everything_before_any_change():
    bm = make(debug=True)
    prefill(bm, "a", [1, 2, 3])
    prefill(bm, "b", [5])
    bm.append_decode_slots(["a", "b"], [None, None])
    before = snapshot(bm)
    bad = [
        (["zz"], [3], [1]),  # unknown sequence
        (["a"], [4], [1]),  # beyond the slots
        (["a"], [-1], [1]),
        (["a"], [2], [1]),  # a known slot
        (["a", "a"], [3, 3], [1, 2]),  # a repeated pair
        (["a"], [3], [-1]), (["a"], [3], [2**63]), (["a"], [3], ["x"]), (["a"], [3], [None]),
        (["a"], [3.0], [1]),
        (["a", "b"], [3], [1, 2]), (["a", "b"], [3, 1], [1]),  # lengths differ
        (["a", "b"], [3, 0], [1, 2]),  # the first pair is fine, the second is not
    ]
    for args in bad:
        with pytest.raises(ValueError):
            bm.set_tokens(*args)
        assert snapshot(bm) == before
    bm.set_tokens(["b", "a"], [1, 3], [6, 4])  # both still unknown: nothing was half done
    bm.step_completed(bm.begin_step())
    bm.mark_computed_many(["a", "b"], [4, 2])
    assert bm.block_key(bm.block_table("a")[0]).token_ids == (1, 2, 3, 4)
    with pytest.raises(ValueError):
        bm.set_tokens(["a"], [3], [4])  # known now


def test_unknown_tokens_follow_fork_rollback_swap_and_all_or_nothing():
    bm = make(num_blocks=6, num_host_blocks=4)  # 5 usable
    prefill(bm, "p", [1, 2, 3])
    bm.append_slots("p", [None])
    bm.step_completed(bm.begin_step())
    bm.mark_computed("p", 4)
    bm.fork("p", "c")  # the child shares the unknown slot
    bm.set_tokens(["p"], [3], [4])
    assert bm.block_key(bm.block_table("p")[0]) is not None
    bm.rollback("c", 1)  # drops the child's unknown slot
    bm.append_slots("c", [None, None])  # CoW of the shared block, then two unknown slots
    bm.rollback("c", 1)
    assert bm.append_decode_slots(["p", "c"], [None, 1]) == []
    before = snapshot(bm)
    assert bm.append_slots("p", [None] * 5 * B) is None  # out of blocks: nothing changed
    assert snapshot(bm) == before and bm.num_allocatable_blocks == 1
    prefill(bm, "q", [1, 2, 3, 4])  # takes the last block
    before = snapshot(bm)
    assert bm.append_decode_slots(["p", "q", "c"], [None, None, 2]) is None  # q needs a block
    assert snapshot(bm) == before
    bm.free("q")
    bm.rollback("p", 1)
    bm.rollback("c", 1)
    bm.swap_out("c")
    bm.set_tokens(["c"], [3], [8])  # swapped out: allowed, keyed after its swap-in
    bm.step_completed(bm.begin_step())
    bm.swap_in("c")
    bm.step_completed(bm.begin_step())
    bm.mark_computed("c", 4)
    assert bm.block_key(bm.block_table("c")[0]).token_ids == (1, 2, 3, 8)


def test_admission_hashes_a_prompt_once_and_follows_changes_in_between():
    calls = []

    def counting_hash(parent, ids, salt):
        calls.append(ids)
        return ids[0]

    bm = make(hash_fn=counting_hash)
    prompt = list(range(13))  # 3 full blocks to look up
    prefill(bm, "a", prompt)
    calls.clear()
    assert bm.can_allocate(prompt)
    assert bm.allocate("b", prompt) == 12
    assert len(calls) == 3  # can_allocate hashed; allocate reused its hits
    bm.free("b")
    bm.free("a")  # a's full blocks wait in the LRU
    assert bm.can_allocate(prompt)
    bm.evict_cached()  # the index changed: allocate looks the prompt up again
    calls.clear()
    assert bm.allocate("c", prompt) == 0  # and finds nothing cached any more
    assert len(calls) == 1
    bm.step_completed(bm.begin_step())
    bm.mark_computed("c", 13)
    changed = list(prompt)
    assert bm.can_allocate(changed)
    changed[5] = 99  # the caller's list changed: not the prompt can_allocate saw
    assert bm.allocate("d", changed) == 4
    assert bm.block_table("d")[0] == bm.block_table("c")[0]
    assert bm.can_allocate(prompt, cache_salt="other")
    assert bm.allocate("e", prompt) == 12  # another salt: looked up again


def test_single_slot_append_fast_path_matches_the_batched_call():
    """``append_slots(s, [t])`` takes its own one-sequence path: the same state as the batched
    call, across a block boundary, with unknown token ids, and all or nothing when the pool is
    dry."""
    twins = [make(num_blocks=5, debug=False) for _ in range(2)]  # 4 usable
    for bm in twins:
        prefill(bm, "a", list(range(6)))  # room 2
    single, batched = twins
    for t in (6, None, 8, 9):  # fills the tail, then starts a fresh block
        assert single.append_slots("a", [t]) == batched.append_decode_slots(["a"], [t]) == []
        assert _decode_state(single, ["a"]) == _decode_state(batched, ["a"])
        single.check_invariants()
    single.set_tokens(["a"], [7], [7])
    batched.set_tokens(["a"], [7], [7])
    assert _decode_state(single, ["a"]) == _decode_state(batched, ["a"])
    assert single.stats() == batched.stats() and single.num_tokens("a") == 10
    prefill(single, "b", list(range(20, 24)))  # takes the last free block
    before = snapshot(single)
    assert single.append_slots("b", [1]) is None  # a full tail and no block left
    assert snapshot(single) == before
    with pytest.raises(ValueError):
        single.append_slots("a", [-1])
    assert snapshot(single) == before
