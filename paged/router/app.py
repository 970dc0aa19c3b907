"""The router's FastAPI app: one `paged.fleet.routing.Router` decision per request, then a relay.

``POST /v1/completions`` and ``POST /v1/chat/completions``: the body is read once, its routing key
taken (`backends.prompt_key`; a body that is not JSON routes as cold), the policy picks among the
backends that are up, and the body goes to that backend unchanged (``httpx.AsyncClient``). The
backend's status, body and ``content-type`` come back unchanged: a 400 stays a 400 with the
backend's error, a stream is relayed chunk by chunk as the bytes arrive (no re-framing), and the
response names its backend in an ``x-paged-backend`` header. A client that hangs up (on a stream,
or while waiting for a whole response: checked every second) closes the upstream connection, so
the backend aborts the request.

A backend that refuses the connection (or does not accept it within ``--connect_timeout``) is
marked down, its prefix tree cleared (a restarted server's cache is empty), and the request is
routed again among the others; the request was never sent, so this is safe. When no backend
takes it the answer is HTTP 502 in OpenAI's error shape (``"type": "server_error"``, ``"code":
"backend_unavailable"``). An error after the request was sent (the backend dies mid-request) is
a 502 too (``"code": "backend_error"``), or, on a stream whose 200 is already sent, one last
``data: {"error": ...}`` event and ``data: [DONE]``, as the server itself ends a failed stream.

A background task scrapes every backend's ``/metrics`` each ``metrics_interval_s`` (the waiting /
running gauges, and whether it answers at all: a down backend comes back up on its first
successful scrape). ``GET /health`` is 200 while some backend is up (503 otherwise), with each
backend's state as JSON; ``GET /v1/models`` is the first backend's that answers; ``GET /metrics``
is the router's own Prometheus text (``paged_router:`` names).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from paged.fleet.routing import POLICIES, Router
from paged.router.backends import Backend, parse_load, prompt_key, token_key

log = logging.getLogger(__name__)

# Request headers not forwarded (hop-by-hop, or recomputed by httpx).
_DROP_REQUEST = frozenset(("host", "content-length", "connection", "keep-alive",
                           "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
                           "proxy-connection", "accept-encoding"))
# Response headers passed back.
_KEEP_RESPONSE = ("content-type", "cache-control", "content-encoding")
BACKEND_HEADER = "x-paged-backend"


@dataclasses.dataclass(frozen=True)
class RouterSettings:
    """The router's settings (the CLI's flags).

    Attributes:
      policy: one of `paged.fleet.routing.POLICIES`.
      load_threshold: ``prefix_aware``: the prefix winner keeps a request while its load is at
        most the least-loaded backend's plus this many requests.
      metrics_interval_s: seconds between scrapes of each backend's ``/metrics``.
      connect_timeout_s: seconds to open a connection to a backend before it counts as down.
      request_timeout_s: seconds to wait for a backend's response (None: no limit; each
        ``paged.server`` has its own ``--request_timeout``).
      max_tree_chars: bound of each backend's prefix tree (characters; LRU leaves dropped).
      prefix_granularity: hits count in whole multiples of this many characters.
      kv_events: each backend's KV event endpoint (``tcp://host:PORT`` of its ``--kv_events``;
        one per backend, in order), to route on the backends' true caches; () for the trees.
    """

    policy: str = "prefix_aware"
    load_threshold: int = 16
    metrics_interval_s: float = 1.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float | None = None
    max_tree_chars: int = 1 << 22
    prefix_granularity: int = 16
    kv_events: tuple[str, ...] = ()

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {POLICIES}")
        for name in ("metrics_interval_s", "connect_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise ValueError(f"{name}={v!r} must be a finite number > 0")
        v = self.request_timeout_s
        if v is not None and not (isinstance(v, (int, float)) and 0 < v < float("inf")):
            raise ValueError(f"request_timeout_s={v!r} must be a finite number > 0 or None")
        for name in ("max_tree_chars", "prefix_granularity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        Router(self.policy, self.load_threshold)  # its own checks


def error_body(message: str, *, type: str = "server_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape (the same as `paged.server.protocol.error_body`)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, code=code), status_code=status)


async def _unless_disconnected(request: Request, coro, poll_s: float = 1.0):
    """``await coro``, unless the client hangs up first (checked every ``poll_s``): then the
    coroutine is cancelled (its upstream connection closed, so the backend aborts the request
    too, as it does for its own clients) and the result is None."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                try:
                    result = await task
                except (asyncio.CancelledError, httpx.HTTPError):
                    result = None
                if isinstance(result, httpx.Response):  # it came back just now
                    await result.aclose()
                return None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task


class _Relay(StreamingResponse):
    """A backend's stream relayed as it arrives; whatever ends it (the last byte, the client
    hanging up, a cancellation) closes the upstream response and ends the backend's in-flight
    request exactly once."""

    def __init__(self, upstream: httpx.Response, backend: Backend, headers: dict):
        self.upstream, self.backend = upstream, backend
        self._closed = False
        super().__init__(self._chunks(), status_code=upstream.status_code, headers=headers)

    async def _chunks(self):
        try:
            async for chunk in self.upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            self.backend.num_errors += 1
            msg = f"backend {self.backend.url} failed mid-stream: {type(e).__name__}: {e}"
            log.warning(msg)
            yield (f"data: {json.dumps(error_body(msg, code='backend_error'))}\n\n"
                   "data: [DONE]\n\n").encode()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.backend.finished()
        with anyio.CancelScope(shield=True):
            await self.upstream.aclose()

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()


class RouterApp:
    """The router's state: its backends, the policy, the HTTP client, the scraper."""

    def __init__(self, backend_urls: list[str], settings: RouterSettings, tokenizer=None):
        if not backend_urls:
            raise ValueError("at least one backend URL is required")
        events = tuple(settings.kv_events)
        if events and len(events) != len(backend_urls):
            raise ValueError(f"{len(events)} kv_events endpoints for {len(backend_urls)} "
                             f"backends: give one per backend, in the same order")
        self.settings = settings
        self.tokenizer = tokenizer  # encodes text prompts for routing on KV events
        self.backends = [Backend(u, max_tree_chars=settings.max_tree_chars,
                                 prefix_granularity=settings.prefix_granularity,
                                 kv_events=events[i] if events else None)
                         for i, u in enumerate(backend_urls)]
        self.router = Router(settings.policy, settings.load_threshold)
        self.client: httpx.AsyncClient | None = None
        self._scraper: asyncio.Task | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(s.request_timeout_s, connect=s.connect_timeout_s, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        await self.scrape()
        self._scraper = asyncio.create_task(self._scrape_forever())

    async def stop(self) -> None:
        for b in self.backends:
            if b.events is not None:
                b.events.close()
        if self._scraper is not None:
            self._scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scraper
        if self.client is not None:
            await self.client.aclose()

    async def _scrape_one(self, b: Backend) -> None:
        if b.events is not None:
            b.events.poll(0)  # keep the view current between requests
        timeout = min(max(self.settings.metrics_interval_s, 0.5), self.settings.connect_timeout_s)
        try:
            r = await self.client.get(b.url + "/metrics", timeout=timeout)
        except httpx.HTTPError as e:
            if b.up:
                log.warning("backend %s is down: %s: %s", b.url, type(e).__name__, e)
                b.failed(f"{type(e).__name__}: {e}")
            return
        if not b.up:
            log.warning("backend %s is up again", b.url)
        b.scraped(parse_load(r.text) if r.status_code == 200 else None)

    async def scrape(self) -> None:
        """One scrape of every backend's ``/metrics`` (concurrently)."""
        await asyncio.gather(*(self._scrape_one(b) for b in self.backends))

    async def _scrape_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.metrics_interval_s)
            try:
                await self.scrape()
            except Exception:  # noqa: BLE001  (the scraper must outlive any one failure)
                log.exception("scrape failed")

    # --- forwarding -------------------------------------------------------------------------------
    def _candidates(self, tried: set[int]) -> list[int]:
        """Backends to route among: those up, else (every one marked down) any not tried yet,
        since a backend may be back before the next scrape notices."""
        up = [i for i, b in enumerate(self.backends) if b.up and i not in tried]
        return up or [i for i in range(len(self.backends)) if i not in tried]

    def pick(self, key, tried: set[int] = frozenset(), tenant: str | None = None) -> int | None:
        """The index of the backend a request with routing key ``key`` goes to (the policy's
        decision among `_candidates`), or None when every backend was tried. With KV events
        ``key`` is the prompt's token ids and ``tenant`` its ``cache_salt`` (`token_key`)."""
        cands = self._candidates(tried)
        if not cands:
            return None
        j = self.router.route(key, [self.backends[i] for i in cands], cache_salt=tenant)
        return cands[j]

    @staticmethod
    def _forward_headers(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}

    async def forward(self, request: Request, path: str, endpoint: str):
        body = await request.body()
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            parsed = None
        key = prompt_key(parsed, endpoint) if isinstance(parsed, dict) else ""
        route_key, tenant = key, None
        if self.settings.kv_events:  # route on the true caches: token ids, or cold ([])
            tk = token_key(parsed, endpoint, self.tokenizer) if isinstance(parsed, dict) else None
            route_key, tenant = tk if tk is not None else ([], None)
        headers = self._forward_headers(request)
        tried: set[int] = set()
        refused = []
        while True:
            i = self.pick(route_key, tried, tenant)
            if i is None:
                return _error(502, "no backend accepted the request: " + "; ".join(refused),
                              "backend_unavailable")
            tried.add(i)
            b = self.backends[i]
            b.routed(key)
            try:
                req = self.client.build_request("POST", b.url + path, content=body,
                                                headers=headers)
                upstream = await _unless_disconnected(request, self.client.send(req, stream=True))
                if upstream is None:  # the client left while the backend worked
                    b.finished()
                    return Response(status_code=499)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                b.finished()
                b.failed(f"{type(e).__name__}: {e}")
                log.warning("backend %s refused a request: %s", b.url, e)
                refused.append(f"{b.url}: {type(e).__name__}: {e}")
                continue
            except httpx.HTTPError as e:
                b.finished()
                b.num_errors += 1
                return _error(502, f"backend {b.url} failed: {type(e).__name__}: {e}",
                              "backend_error")
            except BaseException:
                b.finished()
                raise
            out_headers = {k: upstream.headers[k] for k in _KEEP_RESPONSE if k in upstream.headers}
            out_headers[BACKEND_HEADER] = b.url
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return _Relay(upstream, b, out_headers)
            try:
                content = await _unless_disconnected(request, upstream.aread())
                if content is None:
                    return Response(status_code=499)
            except httpx.HTTPError as e:
                b.num_errors += 1
                return _error(502, f"backend {b.url} failed: {type(e).__name__}: {e}",
                              "backend_error")
            finally:
                b.finished()
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
            out_headers.pop("content-encoding", None)  # aread() decoded it
            return Response(content, status_code=upstream.status_code, headers=out_headers)

    async def models(self):
        refused = []
        for b in sorted(self.backends, key=lambda b: not b.up):
            try:
                r = await self.client.get(b.url + "/v1/models")
            except httpx.HTTPError as e:
                if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    b.failed(f"{type(e).__name__}: {e}")
                refused.append(f"{b.url}: {type(e).__name__}: {e}")
                continue
            return Response(r.content, status_code=r.status_code,
                            headers={"content-type": r.headers.get("content-type",
                                                                   "application/json"),
                                     BACKEND_HEADER: b.url})
        return _error(502, "no backend answered: " + "; ".join(refused), "backend_unavailable")

    # --- metrics ------------------------------------------------------------------------------
    def collect(self):
        """Prometheus families (a custom collector: read from the state at each scrape)."""
        lab = ["backend"]
        fams = {
            "up": GaugeMetricFamily("paged_router:backend_up",
                                    "1 while the backend takes requests.", labels=lab),
            "in_flight": GaugeMetricFamily("paged_router:backend_in_flight",
                                           "Requests this router has open on the backend.",
                                           labels=lab),
            "waiting": GaugeMetricFamily("paged_router:backend_num_requests_waiting",
                                         "The backend's paged:num_requests_waiting at the last "
                                         "scrape.", labels=lab),
            "running": GaugeMetricFamily("paged_router:backend_num_requests_running",
                                         "The backend's paged:num_requests_running at the last "
                                         "scrape.", labels=lab),
            "tree_chars": GaugeMetricFamily("paged_router:backend_prefix_tree_chars",
                                            "Characters in the backend's approximate prefix "
                                            "tree.", labels=lab),
            "requests": CounterMetricFamily("paged_router:backend_requests",
                                            "Requests routed to the backend.", labels=lab),
            "errors": CounterMetricFamily("paged_router:backend_errors",
                                          "Connection failures and failed requests.", labels=lab),
        }
        for b in self.backends:
            st = b.state()
            fams["up"].add_metric([b.url], 1.0 if b.up else 0.0)
            for k in ("in_flight", "waiting", "running", "tree_chars", "requests", "errors"):
                fams[k].add_metric([b.url], float(st[k]))
        routed = CounterMetricFamily("paged_router:routed", "Routing decisions by kind (prefix, "
                                     "cold, overloaded, least_loaded, round_robin, only).",
                                     labels=["decision"])
        for kind, n in sorted(self.router.num_routed.items()):
            routed.add_metric([kind], float(n))
        yield from fams.values()
        yield routed


def build_app(backend_urls: list[str], settings: RouterSettings | None = None,
              tokenizer=None) -> FastAPI:
    """The router's app over ``backend_urls`` (``http://host:port`` of ``paged.server``\\ s).

    The HTTP client and the scraper start with the app (ASGI lifespan) and stop with it;
    ``app.state.router`` is the `RouterApp`. ``tokenizer`` (the backends' model's) encodes text
    prompts for routing on KV events (``settings.kv_events``).
    """
    state = RouterApp(list(backend_urls), settings or RouterSettings(), tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="paged.router", lifespan=lifespan)
    app.state.router = state
    registry = CollectorRegistry(auto_describe=False)
    registry.register(type("_Collector", (), {"collect": lambda self: state.collect()})())

    @app.get("/health")
    async def health():
        body = {"backends": [b.state() for b in state.backends]}
        if any(b.up for b in state.backends):
            return JSONResponse(body)
        return JSONResponse({**error_body("no backend is up", code="backend_unavailable"),
                             **body}, status_code=503)

    @app.get("/v1/models")
    async def models():
        return await state.models()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.forward(request, "/v1/completions", "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.forward(request, "/v1/chat/completions", "chat")

    return app


__all__ = ["BACKEND_HEADER", "RouterApp", "RouterSettings", "build_app", "error_body"]
