"""KV events over ZeroMQ: the publisher's sequence numbers and replay buffer, the subscriber's
gap detection (filled by replay, or marked lost), sockets bound to 127.0.0.1 only, and the
server's ``--kv_events`` (in process, and from an engine-core process): a subscriber's view
equals the block manager's cached keys."""

from __future__ import annotations

import collections
import time

import httpx
import pytest

zmq = pytest.importorskip("zmq")

from server_utils import CONFIG, PROMPTS, free_port, serve_in_thread  # noqa: E402
from server_utils import wait_idle as _wait_idle  # noqa: E402

from paged import Engine  # noqa: E402
from paged.kv.events import MEDIUM_DEVICE, encode_batch  # noqa: E402
from paged.router.kv_subscriber import EventStream, KVEventSubscriber  # noqa: E402
from paged.server.app import ServerSettings, build_app  # noqa: E402
from paged.server.kv_publisher import KVEventPublisher  # noqa: E402


def _stored(h: bytes, parent=None) -> dict:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
            "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
            "lora_name": None}


def _poll_until(sub: KVEventSubscriber, batches: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while sub.stream.num_batches < batches:
        assert time.monotonic() < deadline, f"{sub.stream.num_batches} of {batches} batches"
        sub.poll(50)


def test_stream_detects_gaps_skips_duplicates_and_marks_loss():
    payloads = [encode_batch(0.0, [_stored(bytes([i]))]) for i in range(6)]
    kept = {i: payloads[i] for i in (1, 2, 4)}  # what a replay buffer still holds
    s = EventStream(replay=lambda start: [(i, p) for i, p in sorted(kept.items()) if i >= start])
    s.receive(0, payloads[0])
    s.receive(0, payloads[0])  # duplicate
    s.receive(3, payloads[3])  # 1, 2 missed: replayed
    assert (s.last_seq, s.num_gaps, s.num_replayed, s.lost) == (3, 1, 2, False)
    assert set(s.view.keys()) == {b"\x00", b"\x01", b"\x02", b"\x03"}
    s.receive(5, payloads[5])  # 4 replayed
    assert not s.lost and s.num_gaps == 2
    s2 = EventStream()  # no replay socket: a gap is a loss
    s2.receive(2, payloads[2])
    assert s2.lost and s2.num_gaps == 1
    s2.receive(3, encode_batch(0.0, [{"type": "AllBlocksCleared"}, _stored(b"z")]))
    assert not s2.lost and set(s2.view.keys()) == {b"z"}


def test_late_subscriber_replays_what_it_missed_and_sockets_bind_loopback_only():
    pub = KVEventPublisher(0, 0, data_parallel_rank=1)
    try:
        assert all(e.startswith("tcp://127.0.0.1:") for e in pub.bound), pub.bound
        for i in range(3):  # before anyone subscribes: lost to PUB, kept for replay
            pub.publish([_stored(bytes([i]))])
        while pub.num_published < 3:
            time.sleep(0.01)
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
        try:
            deadline = time.monotonic() + 5
            while sub.stream.num_batches < 4:  # the slow joiner misses some live batches too
                assert time.monotonic() < deadline
                pub.publish([_stored(b"live", b"\x02")])
                sub.poll(50)
            s = sub.stream
            assert s.num_gaps >= 1 and s.num_replayed >= 3 and not s.lost
            assert {b"\x00", b"\x01", b"\x02", b"live"} <= set(sub.view.keys())
        finally:
            sub.close()
    finally:
        pub.close()
    with pytest.raises(ValueError, match="port"):
        KVEventPublisher(70000)


def _digests(bm) -> collections.Counter:
    return collections.Counter(bm.prefix_cache_digests()[0])


def test_server_publishes_events_a_subscriber_rebuilds_the_cache_from():
    engine = Engine(CONFIG)
    port = free_port()
    app = build_app(engine, ServerSettings(served_model_name="tiny", kv_events_port=port))
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    try:
        with serve_in_thread(app) as base:
            for p in PROMPTS + PROMPTS[:2]:
                r = httpx.post(base + "/v1/completions", json={
                    "model": "tiny", "prompt": p * 4, "max_tokens": 4, "temperature": 0},
                    timeout=60)
                assert r.status_code == 200, r.text
                _wait_idle(base)
                deadline = time.monotonic() + 5
                while sub.view.keys(MEDIUM_DEVICE) != _digests(engine.block_manager):
                    assert time.monotonic() < deadline, "the view never matched the cache"
                    sub.poll(50)
            assert sub.view.keys(MEDIUM_DEVICE) and not sub.stream.lost
    finally:
        sub.close()


def test_engine_core_process_publishes_its_events():
    from paged.server.core_client import EngineCoreClient

    port = free_port()
    client = EngineCoreClient(CONFIG, kv_events=port)
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    try:
        app = build_app(client, ServerSettings(served_model_name="tiny"))
        prompt = PROMPTS[0] * 8
        with serve_in_thread(app) as base:
            r = httpx.post(base + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        ids = client.tokenizer.encode(prompt)
        B = CONFIG.block_size
        deadline = time.monotonic() + 10
        while sub.view.match(ids, B)[0] < (len(ids) - 1) // B * B:
            assert time.monotonic() < deadline, "the core's blocks never arrived"
            sub.poll(50)
    finally:
        sub.close()
        client.close()
