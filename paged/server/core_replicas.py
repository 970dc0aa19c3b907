"""`CoreReplicas`: ``data_parallel_size = D`` engine cores, one process each, routed here.

With ``--engine_process`` and D > 1 the server starts D `EngineCoreClient` children (replica
``i`` builds a one-replica engine on the devices in-process replica ``i`` would get) and routes
each request in the server process with `paged.fleet.routing.Router` (``EngineConfig.router``,
``router_load_threshold``), the policy that routes in-process replicas, HTTP backends and the
simulator. It offers the same engine interface as `EngineCoreClient`.

What the router sees of a core: its load is the larger of the requests this front has open there
and the waiting + running the core reported after its last step; its prefix hits are those of a
radix tree of the prompts routed there (`paged.router.backends.PrefixTree`, one character per
token id, hits rounded down to whole blocks), the same approximation as the HTTP router's: blind
to the core's evictions. In process, routing reads the replicas' real prefix caches instead.
"""

from __future__ import annotations

import zmq

from paged.config.support import check_supported
from paged.fleet.routing import Router
from paged.router.backends import PrefixTree
from paged.server.core_client import EngineCoreClient


def start_engine_core(config, *, poll_ms: float = 5.0, kv_events: int | None = None):
    """The engine ``config`` describes, in its own process(es): an `EngineCoreClient`, or
    `CoreReplicas` when ``config.data_parallel_size > 1``; ``kv_events``: the cores publish
    their KV events from that port on (`paged.server.kv_publisher`)."""
    if config.data_parallel_size > 1:
        return CoreReplicas(config, poll_ms=poll_ms, kv_events=kv_events)
    return EngineCoreClient(config, poll_ms=poll_ms, kv_events=kv_events)


class _CoreView:
    """One core as `paged.fleet.routing.Replica` sees it (see the module docstring)."""

    def __init__(self, client: EngineCoreClient, block_size: int):
        self.client = client
        self.tree = PrefixTree()
        self.block_size = block_size

    @property
    def _load(self) -> int:
        s = self.client.kv_stats()
        return max(self.client.num_unfinished, s["num_waiting"] + s["num_running"])

    @property
    def num_waiting(self) -> int:
        return min(self.client.kv_stats()["num_waiting"], self._load)

    @property
    def num_running(self) -> int:
        return self._load - self.num_waiting

    def cached_prefix_tokens(self, token_ids, cache_salt=None, probe=None) -> int:
        key = _key(token_ids, cache_salt)
        b = self.block_size
        return min(self.tree.match(key), len(key)) // b * b


def _key(token_ids, cache_salt) -> str:
    # A salt starts the key, so tenants' prompts never share a path (as they share no block).
    salt = "" if cache_salt is None else repr(cache_salt) + "\x00"
    return salt + "".join(map(chr, token_ids))


class CoreReplicas:
    """D engine-core processes behind one router (see the module docstring).

    Args:
      config: the `EngineConfig` with ``data_parallel_size = D > 1``.
      poll_ms: how long ``step()`` waits for any core's next step.
    """

    def __init__(self, config, *, poll_ms: float = 5.0, kv_events: int | None = None):
        d = config.data_parallel_size
        if d < 2:
            raise ValueError(f"data_parallel_size={d}: use EngineCoreClient for one core")
        check_supported(config, engine_processes=True)
        self.clients: list[EngineCoreClient] = []
        try:
            for i in range(d):
                self.clients.append(EngineCoreClient(config, poll_ms=poll_ms, replica=(i, d),
                                                     kv_events=kv_events))
        except BaseException:
            self.close()
            raise
        first = self.clients[0]
        self.config = config
        self.model_config, self.tokenizer = first.model_config, first.tokenizer
        self._poll_ms = poll_ms
        self.router = Router(config.router, config.router_load_threshold)
        self._views = [_CoreView(c, config.block_size) for c in self.clients]
        self._owner: dict[str, int] = {}  # unfinished request -> its core
        self._poller = zmq.Poller()
        for c in self.clients:
            self._poller.register(c.outputs_socket, zmq.POLLIN)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._owner

    def add_request(self, request_id, prompt, params=None, *, timeout_s=None) -> None:
        """Checks (as ``Engine.add_request``, raising before any state changes), routes, then
        queues the request in its core."""
        rid, token_ids, params, timeout_s = self.clients[0].check(request_id, prompt, params,
                                                                  timeout_s)
        if rid in self._owner:
            raise ValueError(f"duplicate request_id={rid!r}")
        i = self.router.route(token_ids, self._views)
        self.clients[i].add_checked(rid, token_ids, params, timeout_s)
        self._views[i].tree.insert(_key(token_ids, None))
        self._owner[rid] = i

    def replica_of(self, request_id: str) -> int | None:
        """The core an unfinished request was routed to (None once it finished)."""
        return self._owner.get(request_id)

    def abort(self, request_id: str) -> bool:
        i = self._owner.pop(request_id, None)
        return i is not None and self.clients[i].abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def has_step_in_flight(self) -> bool:
        return any(c.has_step_in_flight() for c in self.clients)

    def kv_stats(self) -> dict:
        """The cores' gauges added up, and ``replicas``: each core's own."""
        per = [c.kv_stats() for c in self.clients]
        total = {k: sum(s[k] for s in per) for k in per[0]}
        total["replicas"] = per
        return total

    def warmup(self, *, progress: bool = False) -> int:
        return sum(c.warmup(progress=progress) for c in self.clients)

    def step(self) -> list:
        """The outputs of every core's steps since the last call."""
        self._poller.poll(self._poll_ms)
        outs = []
        for c in self.clients:
            outs += c.step(0)
        for o in outs:
            if o.finished:
                self._owner.pop(o.request_id, None)
        return outs

    def close(self, timeout: float = 10.0) -> None:
        for c in self.clients:
            c.close(timeout)
