"""The host tier's bookkeeping (`paged.kv.blocks.host_tier` through `BlockManager`): device evictions
become offloads, host hits become loads with a ``loading`` wait, nothing is copied twice, a slot
whose content changed or whose write has not run is never served, the tier never holds more than
its slots, and a sequence freed while loading leaves nothing behind. Every manager here runs with
``debug=True``: the invariants of both tiers are checked after every call."""

from __future__ import annotations

import random

import pytest

from paged.fleet.routing import HOST_TIER_WEIGHT, cached_prefix_tokens
from paged.kv.block_manager import BlockManager

A = [1, 2, 3, 4, 5]  # two full blocks of 2 (keyed), the final token's block recomputed
B = [9, 8, 7, 6, 5, 4, 3]


def _bm(num_blocks: int = 5, slots: int = 4, **kw) -> BlockManager:
    return BlockManager(num_blocks, 2, num_host_tier_blocks=slots, debug=True, **kw)


def _step(bm: BlockManager):
    """One device step: its tier copies, then completion."""
    step = bm.begin_step()
    copies = bm.take_tier_copies()
    bm.step_completed(step)
    return copies


def _compute(bm: BlockManager, sid, tokens) -> int:
    hit = bm.allocate(sid, tokens)
    assert hit is not None
    _step(bm)
    bm.mark_computed(sid, len(tokens))
    return hit


def _offload_a(bm: BlockManager) -> list[int]:
    """A computed and freed, then evicted by B: returns the host slots of A's two blocks."""
    _compute(bm, "a", A)
    a_pages = bm.block_table("a")[:2]
    bm.free("a")
    assert bm.allocate("b", B) == 0  # takes every usable block: A's cached blocks are evicted
    copies = _step(bm)
    slot_of = dict(copies.offload)
    assert sorted(slot_of) == sorted(a_pages) and not copies.load
    bm.mark_computed("b", len(B))
    bm.free("b")
    return [slot_of[p] for p in a_pages]


def test_eviction_offloads_and_a_host_hit_loads_after_a_loading_wait():
    bm = _bm()
    offload = _offload_a(bm)
    assert bm.host_tier_stats()["offloaded_blocks"] == 2
    assert bm.tiered_prefix_tokens(A) == (0, 4)
    assert bm.allocate("a2", A) == 4  # both full blocks come from the host tier
    assert bm.is_loading("a2") and bm.loading_tokens("a2") == 4
    table = bm.block_table("a2")
    step = bm.begin_step()
    copies = bm.take_tier_copies()
    # One batched load: A's slots, in order, into the first two fresh blocks.
    assert copies.load == list(zip(offload, table[:2]))
    assert bm.is_loading("a2")  # until the copy step completes
    bm.step_completed(step)
    assert not bm.is_loading("a2") and bm.loading_tokens("a2") == 0
    bm.mark_computed("a2", len(A))  # the loaded blocks are keyed now that their copy ran
    assert bm.block_key(table[0]) is not None and bm.block_key(table[1]) is not None
    stats = bm.host_tier_stats()
    assert (stats["hits"], stats["hit_tokens"], stats["loaded_blocks"]) == (2, 4, 2)


def test_blocks_in_the_tier_are_not_copied_twice():
    bm = _bm()
    _offload_a(bm)
    _compute(bm, "a2", A)  # loaded back into the device
    bm.free("a2")
    before = bm.host_tier_stats()
    assert bm.allocate("c", B) == 6  # B's prefix hits both tiers; A's blocks are evicted again
    copies = _step(bm)
    after = bm.host_tier_stats()
    assert after["offloaded_blocks"] == before["offloaded_blocks"]
    assert after["deduplicated_blocks"] == before["deduplicated_blocks"] + 2
    assert copies is None or not copies.offload


def test_a_slot_whose_copy_has_not_run_is_not_served():
    bm = _bm(num_blocks=7)
    _compute(bm, "a", A)
    bm.free("a")
    assert bm.evict_cached() == 2  # offloads recorded for the coming step, not run yet
    assert bm.allocate("a2", A) == 0 and not bm.is_loading("a2")
    bm.free("a2")
    copies = _step(bm)
    assert len(copies.offload) == 2
    assert bm.allocate("a3", A) == 4 and bm.is_loading("a3")


def test_a_slot_given_new_content_never_serves_the_old_key():
    bm = _bm(num_blocks=5, slots=2)
    _offload_a(bm)
    assert bm.can_allocate(A)  # remembers A's lookup; the tier changes before allocate
    _compute(bm, "c", [20, 21, 22, 23, 24, 25, 26])
    bm.free("c")
    bm.evict_cached()  # B's and C's blocks push A's out of the two slots
    _step(bm)
    assert bm.tiered_prefix_tokens(A) == (0, 0)
    assert bm.allocate("a2", A) == 0 and not bm.is_loading("a2")
    assert bm.host_tier_stats()["evicted_blocks"] >= 2


def test_a_colliding_digest_never_loads_the_wrong_blocks():
    bm = _bm(num_blocks=5, slots=8, hash_fn=lambda parent, ids, salt: b"same")
    a_offload = _offload_a(bm)
    bm.evict_cached()  # B's blocks join A's under the one digest
    _step(bm)
    assert bm.allocate("a2", A) == 4
    copies = _step(bm)
    assert [s for s, _ in copies.load] == a_offload
    bm.free("a2")
    assert bm.tiered_prefix_tokens(A, cache_salt=b"other") == (0, 0)  # salts are keys too


def test_freed_while_loading_leaves_nothing_behind():
    bm = _bm()
    _offload_a(bm)
    usable = bm.num_blocks - 1
    assert bm.allocate("a2", A) == 4 and bm.is_loading("a2")
    bm.free("a2")  # the abort: before the load step even began
    assert not bm.is_loading("a2") and bm.num_used_blocks == 0
    copies = _step(bm)  # the load still runs, into quarantined pages
    assert len(copies.load) == 2
    assert bm.num_quarantined_blocks == 0
    assert bm.num_free_blocks + bm.num_cached_blocks == usable
    stats = bm.host_tier_stats()
    assert stats["held"] == 0 and stats["writing"] == 0
    assert bm.allocate("a3", A) == 4  # the tier still serves it


def test_the_tier_never_holds_more_than_its_slots():
    rng = random.Random(0)
    slots = 3
    bm = _bm(num_blocks=9, slots=slots)
    prefixes = [[100 + i] * 4 for i in range(6)]
    live: list[str] = []
    for i in range(300):
        if live and (len(live) > 2 or rng.random() < 0.4):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            sid = f"s{i}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
            if bm.allocate(sid, tokens) is not None:
                live.append(sid)
        step = bm.begin_step()
        bm.take_tier_copies()
        if rng.random() < 0.8:
            bm.step_completed(step)
        for sid in live:
            if not bm.is_loading(sid):
                bm.mark_computed(sid, bm.num_tokens(sid))
        stats = bm.host_tier_stats()
        assert stats["free"] + stats["cached"] + stats["writing"] + stats["held"] == slots
    stats = bm.host_tier_stats()
    assert stats["offloaded_blocks"] > slots and stats["hits"] > 0 and stats["evicted_blocks"] > 0


def test_the_router_counts_host_hits_at_their_weight():
    bm = _bm()
    _offload_a(bm)
    assert cached_prefix_tokens(bm, A) == int(4 * HOST_TIER_WEIGHT)
    plain = BlockManager(5, 2)
    assert plain.tiered_prefix_tokens(A) == (0, 0) and plain.host_tier_stats() == {}
    assert plain.take_tier_copies() is None and not plain.is_loading("x")


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_host_tier_blocks"):
        BlockManager(5, 2, num_host_tier_blocks=-1)
    with pytest.raises(ValueError, match="sliding"):
        BlockManager(5, 2, num_host_tier_blocks=2, sliding_window=4)


def test_server_metrics_export_the_tier_counters():
    from paged.server.metrics import ServerMetrics

    class FakeEngine:
        def __init__(self):
            self.tier = {"num_blocks": 8, "used_blocks": 2, "hit_tokens": 32,
                         "offloaded_bytes": 4096, "loaded_bytes": 2048, "load_wait_s": 0.5}

        def kv_stats(self):
            return {"num_running": 1, "num_waiting": 0, "num_blocks": 9, "num_used_blocks": 3,
                    "prefix_cache_hit_tokens": 48, "num_preemptions": 0,
                    "host_tier": dict(self.tier)}

    m, engine = ServerMetrics(), FakeEngine()
    m.update_engine(engine)
    engine.tier["hit_tokens"] = 40
    m.update_engine(engine)
    text = m.render().decode()
    assert "paged:host_tier_hit_tokens_total 40.0" in text
    assert "paged:host_tier_offloaded_bytes_total 4096.0" in text
    assert "paged:host_tier_loaded_bytes_total 2048.0" in text
    assert "paged:host_tier_load_wait_seconds_total 0.5" in text
    assert "paged:host_tier_usage_perc 0.25" in text


def test_the_tier_is_refused_with_disaggregated_replicas():
    """A decode replica receives its prompt's pages from a prefill replica; a host-tier load on
    either side is not part of the hand-over's rules yet, so the pair is refused at once."""
    from paged.config.engine_config import EngineConfig

    with pytest.raises(ValueError, match="prefill_replicas=1 needs host_kv_cache_bytes=0"):
        EngineConfig(data_parallel_size=2, prefill_replicas=1, host_kv_cache_bytes=1 << 20)
