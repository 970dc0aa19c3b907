"""The FastAPI app: OpenAI's completions and chat completions, models, health, metrics.

Every handler checks its request completely before anything reaches the engine: the body is
parsed (`protocol.parse`), the model name matched, prompts tokenized and checked against
``max_model_len`` and the vocabulary, and SamplingParams built, all on the server's event loop
with the tokenizer and the engine's (immutable) configs only. A bad request is answered 400/404
in OpenAI's error shape; the engine never sees it.

Accepted requests go to the `EngineLoop` (a ``Stream`` of one engine request per prompt). A
streaming response sends one SSE event per choice that got new text (several engine steps that
arrive together are merged into one event), ends each choice with its ``finish_reason``, then an
optional usage chunk (``stream_options.include_usage``) and ``data: [DONE]``. When a streaming
client hangs up, the response task is cancelled and its requests are aborted in the engine by the
next loop iteration (their blocks freed); a non-streaming request whose client left is aborted
too (checked every second while it waits).

A request that times out (``--request_timeout``) or is aborted by the server: a non-streaming one
gets HTTP 504 (``"type": "timeout_error"``, ``"code": "request_timeout"``) or 503; a streaming
one, whose 200 status is already sent, gets one last event ``data: {"error": {...}}`` in the
same shape and then ``data: [DONE]`` (no choice is reported finished: ``finish_reason`` stays
null). OpenAI's client raises ``APIError`` on that event.

Log-probabilities: completions' ``logprobs: k`` and chat's ``logprobs: true`` with
``top_logprobs: k`` set ``SamplingParams.logprobs = k`` and come back in OpenAI's shapes (legacy
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``, chat ``content[]``). With
``echo`` the prompt's tokens are scored too, first (OpenAI's: the first one's null). vLLM's
``prompt_logprobs: k`` sets ``SamplingParams.prompt_logprobs`` and comes back as each completion
choice's (chat: the response's) ``prompt_logprobs`` in a non-streaming response (a stream does
not carry them; with ``echo`` its first chunk's ``logprobs`` score the prompt). Every choice carries vLLM's
``stop_reason`` (the stop string or stop token id that ended it). Chat roles outside
`protocol.ROLES` are a 400.

Chat messages are rendered as the library renders a conversation (`paged.request.chat`): with
the tokenizer's chat template when it has one, otherwise with a plain template, encoded as text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import paged.server.protocol as protocol
from paged.request.chat import chat_text
from paged.server.engine_loop import EngineLoop, Stream
from paged.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from paged.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from paged.server.raw_send import EventStream, keep_raw_send
from paged.server.streams import CLIENT_REASONS, Choice

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What the server adds to the engine's settings.

    Attributes:
      served_model_name: the model id of ``/v1/models`` and responses; requests naming another
        model get 404 (the engine's ``EngineConfig.model`` name is accepted too).
      max_waiting: requests that may wait (accepted, not running) before new ones get 503.
      request_timeout_s: per-request timeout passed to the engine (None: the engine's
        ``request_timeout_s``).
      api_key: when set, every ``/v1/*`` request must carry ``Authorization: Bearer <api_key>``
        (else 401 in OpenAI's error shape, ``"code": "invalid_api_key"``); ``/health`` and
        ``/metrics`` stay open. ``python -m paged.server --api_key`` or ``PAGED_API_KEY``.
      metrics_prefix: the Prometheus names' prefix, ``"paged"`` or ``"vllm"`` (vLLM's names, for
        dashboards built on them).
      warmup: compile every step a request can select (``Engine.warmup``) in the engine thread
        once the app starts; meanwhile ``/health`` and ``/v1/*`` answer 503 with ``Retry-After``.
      kv_events_port: publish the in-process engine's KV events from this port on
        (`paged.server.kv_publisher`; None: not published).
    """

    served_model_name: str = "tiny"
    max_waiting: int = 256
    request_timeout_s: float | None = None
    api_key: str | None = None
    warmup: bool = False
    metrics_prefix: str = "paged"
    kv_events_port: int | None = None


def build_app(engine, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving ``engine`` (which from now on only its `EngineLoop` thread may call).

    The loop starts with the app (ASGI lifespan) and stops with it; ``app.state.loop`` is it.
    """
    settings = settings or ServerSettings()
    engine_loop = EngineLoop(engine, max_waiting=settings.max_waiting,
                             request_timeout_s=settings.request_timeout_s, warmup=settings.warmup,
                             metrics=ServerMetrics(settings.metrics_prefix))
    if settings.kv_events_port is not None:
        from paged.server.kv_publisher import attach_publishers

        engine_loop.kv_events = attach_publishers(engine, settings.kv_events_port)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()
            if engine_loop.kv_events is not None:
                engine_loop.kv_events.close()

    app = FastAPI(title="paged", lifespan=lifespan)
    keep_raw_send(app, _gate(settings, engine_loop))
    app.state.loop = engine_loop
    app.state.settings = settings
    api = _Api(engine, engine_loop, settings)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):  # unknown route, wrong method
        what = {404: "no such route", 405: "method not allowed on"}.get(e.status_code, e.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(protocol.error_body(f"{what} {request.method} {request.url.path}",
                                                code=code),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            return JSONResponse(protocol.error_body("engine loop is not running", type="server_error"),
                                status_code=500)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "created": api.created,
            "owned_by": "paged", "max_model_len": engine.config.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(engine_loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = protocol.parse(CompletionRequest, await request.body())
        return await api.serve(request, "completion", req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = protocol.parse(ChatCompletionRequest, await request.body())
        return await api.serve(request, "chat", req)

    return app


def _gate(settings: ServerSettings, engine_loop: EngineLoop):
    """What the outermost layer answers itself, before any route: ``/v1/*`` without the API key
    (401), ``/v1/*`` and ``/health`` while the engine still compiles (503 with ``Retry-After``).
    Returns ``gate(scope) -> (status, body, headers) | None``."""
    want = None if settings.api_key is None else f"Bearer {settings.api_key}".encode()

    def gate(scope):
        path = scope.get("path", "")
        api = path == "/v1" or path.startswith("/v1/")
        if want is not None and api:
            got = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(got, want):
                return 401, protocol.error_body(
                    "Incorrect or missing API key: send the header 'Authorization: Bearer "
                    "<key>' with the server's --api_key", code="invalid_api_key"), {}
        if (api or path == "/health") and not engine_loop.ready and engine_loop.alive:
            return 503, protocol.error_body(
                f"the server is still compiling its step shapes ({engine_loop.warmup_status}); "
                f"retry shortly", type="server_error", code="warming_up"), {"retry-after": "2"}
        return None

    return gate


class _Api:
    """The checks and the response logic shared by both generation endpoints."""

    def __init__(self, engine, engine_loop: EngineLoop, settings: ServerSettings):
        self.loop, self.settings = engine_loop, settings
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.max_num_seqs = engine.config.max_num_seqs
        self.vocab_size = engine.model_config.vocab_size
        self.names = {settings.served_model_name, engine.config.model}
        self.created = int(time.time())

    # --- checks (no engine state) -------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise ApiError(f"The model `{name}` does not exist; this server serves "
                           f"`{self.settings.served_model_name}`", status=404, param="model",
                           code="model_not_found")

    def encode(self, text: str, param: str) -> list[int]:
        if not text:
            raise ApiError(f"{param} is empty", param=param)
        try:
            return list(self.tokenizer.encode(text))
        except (TypeError, ValueError) as e:
            raise ApiError(f"{param}: {e}", param=param) from None

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise ApiError(f"{param} is empty", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(f"{param}: token id {bad} is outside the vocabulary [0, "
                           f"{self.vocab_size})", param=param)
        return ids

    def completion_prompts(self, prompt) -> list[list[int]]:
        if prompt is None:
            raise ApiError("prompt is required", param="prompt")
        if isinstance(prompt, str):
            return [self.encode(prompt, "prompt")]
        if not prompt:
            raise ApiError("prompt is an empty list", param="prompt")
        if isinstance(prompt[0], str):
            return [self.encode(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if isinstance(prompt[0], int):
            return [self.check_ids(list(prompt), "prompt")]
        return [self.check_ids(list(p), f"prompt[{i}]") for i, p in enumerate(prompt)]

    def chat_prompt(self, messages) -> list[int]:
        if not messages:
            raise ApiError("messages is required (a non-empty list)", param="messages")
        msgs = []
        for i, m in enumerate(messages):
            if m.role not in protocol.ROLES:
                raise ApiError(f"messages[{i}].role={m.role!r} must be one of {protocol.ROLES}",
                               param=f"messages[{i}].role")
            content = m.content
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content
                                  if part.get("type") == "text")
            msgs.append({"role": m.role, "content": content or ""})
        try:  # a template may refuse a conversation (raise_exception)
            text = chat_text(self.tokenizer, msgs)  # the library's rendering (paged.request.chat)
        except ValueError as e:
            raise ApiError(f"messages: {e}", param="messages") from None
        return self.encode(text, "messages")

    def check_lengths(self, prompts: list[list[int]], max_tokens: int | None,
                      param: str) -> int | None:
        """The max_tokens to use (None: what is left of each prompt's context, resolved by the
        engine as for a library request), or ApiError."""
        longest = max(len(p) for p in prompts)
        if longest >= self.max_model_len:
            raise ApiError(f"This model's maximum context length is {self.max_model_len} tokens. "
                           f"However, your prompt has {longest} tokens (at least one output "
                           f"token must fit).", param=param, code="context_length_exceeded")
        if max_tokens is None:
            return None
        if max_tokens >= 1 and longest + max_tokens > self.max_model_len:
            raise ApiError(f"This model's maximum context length is {self.max_model_len} tokens. "
                           f"However, you requested {longest + max_tokens} tokens ({longest} in "
                           f"the prompt, {max_tokens} for the completion). Please reduce the "
                           f"prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    # --- serving --------------------------------------------------------------------------------
    async def serve(self, request: Request, kind: str, req):
        self.check_model(req.model)
        if kind == "completion":
            if req.suffix:
                raise ApiError("suffix is not supported by this server", param="suffix",
                               code="unsupported_parameter")
            if req.best_of not in (None, req.n):
                raise ApiError("best_of != n is not supported by this server", param="best_of",
                               code="unsupported_parameter")
            prompts = self.completion_prompts(req.prompt)
            max_tokens = self.check_lengths(prompts, req.max_tokens, "prompt")
            logprobs = req.logprobs
        else:
            prompts = [self.chat_prompt(req.messages)]
            wanted = req.max_completion_tokens if req.max_completion_tokens is not None \
                else req.max_tokens
            max_tokens = self.check_lengths(prompts, wanted, "messages")
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        stops = protocol.stop_strings(req.stop)
        echo = kind == "completion" and req.echo
        plp = req.prompt_logprobs
        if echo and logprobs is not None:  # the echoed prompt is scored as well
            plp = max(plp or 0, logprobs)
        params = protocol.sampling_params(req, max_tokens, logprobs=logprobs, stop=stops,
                                          prompt_logprobs=plp)
        if req.n > self.max_num_seqs:
            raise ApiError(f"n={req.n} > max_num_seqs={self.max_num_seqs}", param="n")
        shapes = protocol.Shapes(kind, req.model or self.settings.served_model_name)
        job = _Job(self, shapes, prompts, params, stops, req.n, incremental=req.stream,
                   echo=[self.tokenizer.decode(p) for p in prompts] if echo else None,
                   logprobs=logprobs, report_prompt=req.prompt_logprobs is not None)
        self.loop.submit(job.stream)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(job.events(include_usage), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        return await job.collect(request)


class _Job:
    """One HTTP request in flight: its engine requests, choices and response shapes."""

    def __init__(self, api: _Api, shapes, prompts, params, stops, n, *, incremental, echo,
                 logprobs=None, report_prompt=False):
        self.api, self.shapes, self.prompts, self.n, self.echo = api, shapes, prompts, n, echo
        self.logprobs = logprobs  # k (top log-probabilities per token), or None
        self.report_prompt = report_prompt  # the choices carry prompt_logprobs
        self.plps: list = [None] * len(prompts)  # each prompt's, once they arrive
        rids = [f"{shapes.id}-{i}" for i in range(len(prompts))]
        self.stream = Stream([(rid, p, params) for rid, p in zip(rids, prompts)],
                             logprobs=logprobs is not None,
                             prompt_logprobs=params.prompt_logprobs is not None)
        decode = api.tokenizer.decode
        self.choices = [Choice(t * n + j, decode, stops, incremental)
                        for t in range(len(prompts)) for j in range(n)]
        self.open = set(range(len(prompts)))  # prompts whose engine request is unfinished
        self.reported: set[int] = set()  # choices whose finish_reason was sent

    def _take(self, item) -> tuple[list[Choice], ApiError | None]:
        """Applies one queue item; returns the choices it touched and an error, if any."""
        if item[0] == "error":
            return [], item[2]
        _, tag, outs, finished, _info, plps = item
        if plps is not None:
            self.plps[tag] = plps
        touched = []
        for idx, new_ids, reason, new_lps, stop_text, stop_reason in outs:
            c = self.choices[tag * self.n + idx]
            if not c.done:
                c.stop_reason = stop_reason
                c.token_ids += new_ids  # the loop hands out deltas
                if new_lps is not None:
                    if c.lps is None:
                        c.lps = []
                    c.lps.extend(new_lps)
                c.update(c.token_ids, reason, stop_text)
                touched.append(c)
        if finished:
            self.open.discard(tag)
        err = None
        bad = next((c for c in touched if c.done and c.finish_reason not in CLIENT_REASONS), None)
        if bad is not None:
            if bad.finish_reason == "timeout":
                err = ApiError("request timed out (the server's --request_timeout)", status=504,
                               type="timeout_error", code="request_timeout")
            else:
                err = ApiError("request aborted by the server", status=503, type="server_error",
                               code="aborted")
        return touched, err

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def _logprobs(self, c: Choice, *, streaming: bool) -> dict | None:
        """The logprobs object of ``c``'s tokens not reported yet (all of them when not
        streaming); None when not asked for. While streaming, the tokens of a chunk's logprobs
        are those that arrived with it, which may run ahead of its text by the characters held
        back (incomplete UTF-8, a possible stop string)."""
        if self.logprobs is None or c.lps is None:
            return None
        start = c.lp_sent if streaming else 0
        lps = c.new_logprobs() if streaming else c.lps[:c.num_tokens]
        if streaming and not lps:
            return None
        ids = c.token_ids[start:start + len(lps)]
        decode = self.api.tokenizer.decode
        if self.shapes.kind == "completion":
            out = protocol.completion_logprobs(ids, lps, decode)
            if self.echo is not None and start == 0:  # the echoed prompt's, first
                tag = c.index // self.n
                out = protocol.echo_logprobs(self.prompts[tag], self.plps[tag], decode, out)
            return out
        return protocol.chat_logprobs(ids, lps, decode, self.logprobs)

    def _usage(self) -> dict:
        return protocol.usage(sum(len(p) for p in self.prompts),
                              sum(c.num_tokens for c in self.choices))

    def _abort_open(self) -> None:
        if self.open:
            self.api.loop.abort([self.stream.requests[t][0] for t in sorted(self.open)])
            self.open.clear()

    async def events(self, include_usage: bool):
        """The SSE events of a streaming response (see the module docstring)."""
        shapes, queue = self.shapes, self.stream.queue
        try:
            if shapes.kind == "chat":
                first = "".join(shapes.chunk(c.index, "", None, first=True) for c in self.choices)
                for c in self.choices:
                    c.started = True
                yield first
            while not self.done:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                parts, err, touched = [], None, {}
                for item in items:
                    got, e = self._take(item)
                    err = err or e
                    touched.update((c.index, c) for c in got)
                for i in sorted(touched):
                    c = touched[i]
                    text = c.delta()
                    if not c.started and self.echo is not None:
                        text = self.echo[i // self.n] + text
                    c.started = True
                    fin = c.finish_reason if c.done and c.finish_reason in CLIENT_REASONS else None
                    if fin is not None:
                        self.reported.add(i)
                    lp = self._logprobs(c, streaming=True)
                    if text or fin is not None or lp:
                        why = c.stop_reason if fin is not None else None
                        parts.append(shapes.chunk(i, text, fin, logprobs=lp, stop_reason=why))
                if err is not None:
                    parts.append(protocol.sse(err.body()))
                    yield "".join(parts) + protocol.SSE_DONE
                    return
                if parts:
                    yield "".join(parts)
            tail = shapes.usage_chunk(self._usage()) if include_usage else ""
            yield tail + protocol.SSE_DONE
        finally:
            self._abort_open()

    async def collect(self, request: Request):
        """The whole response of a non-streaming request."""
        queue = self.stream.queue
        try:
            while not self.done:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:  # noqa: UP041  (not the builtin before 3.11)
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                _, err = self._take(item)
                if err is not None:
                    raise err
        finally:
            self._abort_open()
        choices = []
        decode = self.api.tokenizer.decode
        plps = [protocol.prompt_logprobs(p, decode) if self.report_prompt else None
                for p in self.plps]
        for c in self.choices:
            text = c.text if self.echo is None else self.echo[c.index // self.n] + c.text
            choices.append((c.index, text, c.finish_reason, self._logprobs(c, streaming=False),
                            c.stop_reason, plps[c.index // self.n]))
        chat_plps = plps[0] if self.shapes.kind == "chat" else None
        return self.shapes.response(choices, self._usage(), chat_plps)
