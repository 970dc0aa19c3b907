"""KV events (`paged.kv.events`): the stream of one block manager, replayed by a subscriber's
`KVCacheView`, rebuilds the prefix-cache indexes exactly (device and host tier) after every call
of random traffic; the wire layout is vLLM's; a view answers prefix queries as the manager does."""

from __future__ import annotations

import collections
import random

import msgpack
import pytest

from paged.kv.block_manager import BlockManager
from paged.kv.events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    KVCacheView,
    KVEventSink,
    decode_batch,
    encode_batch,
)

B = 4


def _same(bm: BlockManager, view: KVCacheView) -> None:
    device, host = bm.prefix_cache_digests()
    assert view.keys(MEDIUM_DEVICE) == collections.Counter(device)
    assert view.keys(MEDIUM_HOST) == collections.Counter(host)


def _prompt(rng: random.Random) -> list[int]:
    # A few families of shared prefixes, so chains share blocks, hit, and get evicted.
    family = rng.randrange(4)
    head = [family * 50 + i for i in range(rng.choice((4, 8, 12)))]
    return head + [rng.randrange(1000, 1010) for _ in range(rng.randrange(1, 10))]


@pytest.mark.parametrize("tier", [0, 6], ids=["device", "host_tier"])
def test_event_replay_rebuilds_the_indexes_after_every_call(tier):
    rng = random.Random(tier)
    bm = BlockManager(16, B, num_host_tier_blocks=tier, quarantine_steps=0)
    sink, view = KVEventSink(), KVCacheView()
    bm.set_event_sink(sink)
    live, n = [], 0

    def sync():
        # Each batch goes over the wire and back, as a subscriber receives it.
        view.apply(decode_batch(encode_batch(0.0, sink.take()))[1])
        _same(bm, view)

    for _ in range(300):
        step = bm.begin_step()
        if live and (rng.random() < 0.5 or len(live) > 3):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            p = _prompt(rng)
            if bm.can_allocate(p):
                sid = f"s{n}"
                n += 1
                bm.allocate(sid, p)
                bm.mark_computed(sid, len(p))
                live.append(sid)
        bm.step_completed(step)
        sync()
    assert bm.stats()["evictions"] > 10 and view.num_events > 50
    if tier:
        assert bm.host_tier_stats()["offloaded_blocks"] > 5
    for sid in live:
        bm.free(sid)
    bm.evict_cached()
    sync()
    assert not view.keys(MEDIUM_DEVICE)
    # A sink attached to a cache that is not empty reports what it holds first.
    p = list(range(1, 14))
    bm.allocate("late", p)
    bm.mark_computed("late", len(p))
    view2 = KVCacheView()
    bm.set_event_sink(sink2 := KVEventSink())
    view2.apply(sink2.take())
    _same(bm, view2)


def test_events_have_vllms_fields_and_layout():
    bm = BlockManager(16, B, quarantine_steps=0)
    sink = KVEventSink()
    bm.set_event_sink(sink)
    p = list(range(1, 11))  # two full blocks
    bm.allocate("a", p, cache_salt=b"model|tenant:acme")
    bm.mark_computed("a", len(p))
    bm.free("a")
    bm.evict_cached()
    payload = encode_batch(12.5, sink.take(), 3)
    ts, events, rank = msgpack.unpackb(payload)  # the batch is an array
    assert (ts, rank) == (12.5, 3)
    stored, removed, cleared = events
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert stored["token_ids"] == list(range(1, 9)) and stored["block_size"] == B
    assert len(stored["block_hashes"]) == 2  # one event per chain, as vLLM stores them
    assert all(isinstance(h, bytes) and len(h) == 16 for h in stored["block_hashes"])
    assert stored["medium"] == "GPU" and stored["extra_keys"] == [["acme"], None]
    assert {"lora_id", "lora_name"} <= set(stored)
    assert removed == {"type": "BlockRemoved", "block_hashes": stored["block_hashes"][::-1],
                       "medium": "GPU"}
    assert cleared == {"type": "AllBlocksCleared"}
    # The legacy layout (every event an array, tag first) decodes to the same maps.
    legacy = msgpack.packb([1.0, [["BlockRemoved", [b"x"], "GPU"], ["AllBlocksCleared"]], None])
    assert decode_batch(legacy)[1] == [
        {"type": "BlockRemoved", "block_hashes": [b"x"], "medium": "GPU"},
        {"type": "AllBlocksCleared"}]
    with pytest.raises(ValueError, match="not a KVEventBatch"):
        decode_batch(b"\x01")


def test_view_answers_prefix_queries_as_the_manager():
    rng = random.Random(7)
    bm = BlockManager(24, B, num_host_tier_blocks=8, quarantine_steps=0)
    sink, view = KVEventSink(), KVCacheView()
    bm.set_event_sink(sink)
    for i in range(40):
        p = _prompt(rng)
        salt = b"|tenant:t1" if i % 5 == 0 else None
        step = bm.begin_step()
        if bm.can_allocate(p, cache_salt=salt):
            bm.allocate(i, p, cache_salt=salt)
            bm.mark_computed(i, len(p))
            bm.free(i)
        bm.step_completed(step)
        # A host slot is indexed (and reported) when its offload is planned, loadable once the
        # next step completes: compare after it.
        bm.step_completed(bm.begin_step())
        view.apply(sink.take())
        for _ in range(3):
            q = _prompt(rng)
            assert view.match(q, B) == bm.tiered_prefix_tokens(q)
            assert view.match(q, B, "t1") == bm.tiered_prefix_tokens(q, cache_salt=b"|tenant:t1")
