"""The HTTP router on KV events: each backend's view (rebuilt from its replica's events over
ZeroMQ) equals the replica's prefix cache after every batch of events, and the router routes a
prompt to the replica that truly holds its prefix (where the approximate trees would not)."""

from __future__ import annotations

import collections
import time

import pytest

pytest.importorskip("zmq")

from server_utils import CONFIG, free_port  # noqa: E402

from paged import Engine, SamplingParams  # noqa: E402
from paged.router.app import RouterApp, RouterSettings  # noqa: E402
from paged.router.backends import token_key  # noqa: E402
from paged.server.kv_publisher import attach_publishers  # noqa: E402

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _wait_equal(backend, engine, timeout: float = 5.0) -> None:
    want = collections.Counter(engine.block_manager.prefix_cache_digests()[0])
    deadline = time.monotonic() + timeout
    while True:
        backend.events.poll(20)
        if backend.events.view.keys() == want:
            return
        assert time.monotonic() < deadline, "the router's view never matched the replica"


def test_router_views_equal_the_replicas_caches_and_route_on_them():
    engines = [Engine(CONFIG), Engine(CONFIG)]
    ports = [free_port(), free_port()]
    pubs = [attach_publishers(e, p) for e, p in zip(engines, ports)]
    app = RouterApp(["http://127.0.0.1:1", "http://127.0.0.1:2"],
                    RouterSettings(kv_events=tuple(f"tcp://127.0.0.1:{p}" for p in ports)),
                    tokenizer=engines[0].tokenizer)
    try:
        time.sleep(0.2)  # let the subscriptions connect (a late start is replayed anyway)
        tok = engines[0].tokenizer
        shared = "The quick brown fox jumps over the lazy dog. " * 2
        prompts = [["x" * 50 + "a", "w" * 40], [shared + "B", "y" * 50 + "z"]]
        n = 0
        for engine, pub, backend, batch in zip(engines, pubs, app.backends, prompts):
            for text in batch:
                engine.add_request(f"r{n}", tok.encode(text), GREEDY)
                n += 1
                while engine.has_unfinished_requests() or engine.has_step_in_flight():
                    engine.step()
                    pub.flush()  # one batch of events per step, as the server publishes
                    _wait_equal(backend, engine)
        assert all(b.events.stream.num_batches >= 2 and not b.events.stream.lost
                   for b in app.backends)
        # A prompt continuing replica 1's cached prefix goes to replica 1, one continuing
        # replica 0's goes to 0; the view counts exactly the replica's hit tokens.
        for text, want in ((shared + "B and more", 1), ("x" * 50 + "q", 0),
                           ("y" * 50 + "zz", 1)):
            ids, tenant = token_key({"prompt": text}, "completion", tok)
            assert app.pick(ids, tenant=tenant) == want, text
            hits = [b.cached_prefix_tokens(ids) for b in app.backends]
            assert hits == [e.block_manager.cached_prefix_tokens(ids) for e in engines]
        # Evictions reach the view too: the replica's reset empties it.
        assert engines[1].reset_prefix_cache()
        pubs[1].flush()
        _wait_equal(app.backends[1], engines[1])
        assert not app.backends[1].events.view.keys()
        ids, _ = token_key({"prompt": shared + "B and more"}, "completion", tok)
        assert app.backends[1].cached_prefix_tokens(ids) == 0
    finally:
        for p in pubs:
            p.close()
        for b in app.backends:
            b.events.close()


def test_bad_kv_events_settings_are_one_clear_error():
    with pytest.raises(ValueError, match="1 kv_events endpoints for 2 backends"):
        RouterApp(["http://a:1", "http://b:2"], RouterSettings(kv_events=("tcp://127.0.0.1:9",)))
    assert token_key({"messages": []}, "chat") is None
    assert token_key({"prompt": "abc"}, "completion") is None  # text needs a tokenizer
    assert token_key({"prompt": [1, 2], "cache_salt": "t"}, "completion") == ([1, 2], "t")
