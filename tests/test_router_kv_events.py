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


# --- event-driven routing against direct reads, in the simulator ------------------------------
class EventViewRouter:
    """A `Router` that reads each replica's cache from a `KVCacheView` fed by its KV events,
    which become visible ``lag_s`` after the router could first have seen them (a model of the
    publish + network delay); the direct router reads the block managers themselves."""

    def __init__(self, lag_s: float, **kw):
        from paged.fleet.routing import Router

        self.router = Router("prefix_aware", **kw)
        self.policy, self.num_routed = self.router.policy, self.router.num_routed
        self.lag_s = lag_s
        self.views = None
        self.pending: list[collections.deque] = []
        self.now = 0.0

    def route(self, token_ids, replicas, cache_salt=None, loads=None) -> int:
        from paged.kv.events import KVCacheView, KVEventSink

        if self.views is None:
            self.sinks = [KVEventSink() for _ in replicas]
            for r, s in zip(replicas, self.sinks):
                r.block_manager.set_event_sink(s)
            self.views = [KVCacheView() for _ in replicas]
            self.pending = [collections.deque() for _ in replicas]
        t = self.now
        views = []
        for r, sink, view, q in zip(replicas, self.sinks, self.views, self.pending):
            q.append((t, sink.take()))
            while q and q[0][0] <= t - self.lag_s:
                view.apply(q.popleft()[1])
            views.append(_ViewReplica(r, view, r.block_manager.block_size))
        return self.router.route(token_ids, views, cache_salt, loads)


class _ViewReplica:
    def __init__(self, replica, view, block_size):
        self.r, self.view, self.block_size = replica, view, block_size

    @property
    def num_waiting(self):
        return self.r.num_waiting

    @property
    def num_running(self):
        return self.r.num_running

    def cached_prefix_tokens(self, token_ids, cache_salt=None, probe=None) -> int:
        from paged.fleet.routing import HOST_TIER_WEIGHT

        device, host = self.view.match(list(token_ids), self.block_size)
        return device + int(host * HOST_TIER_WEIGHT)


def _documents_workload(n: int, rate: float, seed: int = 0):
    """Requests over 24 shared documents (256 tokens, Zipf-like popularity), each with its own
    32-token question; Poisson arrivals."""
    import numpy as np

    from paged.workload.workload import RequestSpec, Workload

    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 30000, 256).tolist() for _ in range(24)]
    p = 1.0 / np.arange(1, 25)
    p /= p.sum()
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.exponential(1.0 / rate)
        doc = docs[rng.choice(24, p=p)]
        prompt = tuple(doc + rng.integers(1, 30000, 32).tolist())
        reqs.append(RequestSpec(f"q{i}", t, prompt, None, len(prompt), 32))
    return Workload("documents", tuple(reqs), "constructed", seed, {"docs": 24, "doc_len": 256})


def _hit_tokens(router, w) -> int:
    from paged import EngineConfig
    from paged.sim import H200, LLAMA3_8B, RooflineStepModel, Simulator

    cfg = EngineConfig(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512,
                       block_size=16, async_scheduling=False, num_blocks=200, model="sim",
                       dtype="bfloat16")
    sim = Simulator(cfg, RooflineStepModel(H200, LLAMA3_8B, block_size=16), num_replicas=4,
                    router=router, model_config=LLAMA3_8B, build_device=False)
    if isinstance(router, EventViewRouter):  # the event loop passes no clock: give it arrivals
        orig = router.route
        arrivals = iter(r.arrival_s for r in w.requests)

        def route(*a, **k):
            router.now = next(arrivals)
            return orig(*a, **k)

        router.route = route
    return sim.run(w).summary["prefix_cache_hit_tokens"]


def test_event_router_hits_as_much_as_direct_reads_in_the_simulator():
    # With no lag the views are the caches: the same decisions, the same hits. With a 10 ms
    # lag the goal of issue 43 holds: >= 95 % of the direct router's prefix hits.
    from paged.fleet.routing import Router

    w = _documents_workload(300, 20.0)
    direct = _hit_tokens(Router("prefix_aware"), w)
    assert direct > 0.5 * sum(r.prompt_len for r in w.requests)
    assert _hit_tokens(EventViewRouter(0.0), w) == direct
    assert _hit_tokens(EventViewRouter(0.01), w) >= 0.95 * direct
