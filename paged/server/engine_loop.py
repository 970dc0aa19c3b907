"""`EngineLoop`: the one thread that calls the engine.

Request handlers never touch the engine. They `submit` checked requests (token ids and
SamplingParams built in the handler) and `abort` them; both only append a command to a queue
under a condition variable. The loop thread drains the commands, calls ``engine.add_request`` /
``engine.abort``, steps while there is work (unfinished requests or a step in flight), and sleeps
on the condition when idle. After each step it hands every stream its new outputs with one
``loop.call_soon_threadsafe`` per step (not one per request), and updates the metrics.

What a stream's asyncio queue receives (`Item`): ``("out", tag, choices, finished, info,
prompt_logprobs)`` with ``choices`` a list of ``(sample index, the token ids new since the
stream's previous item, finish reason, those tokens' log-probabilities or None, the text cut at
the stop string when one ended the sample or None, vLLM's stop_reason: the stop string or stop
token id that ended it, or None)`` (deltas, so a stream of n tokens copies O(n) ids in all, not
per step; the stream appends them), ``info`` (prompt tokens, cached tokens) on the last item,
and the request's ``prompt_logprobs`` (`paged.request.outputs.RequestOutput.prompt_logprobs`)
when the stream asked for them, else None; or ``("error", tag, ApiError)``.

A fatal engine error (the engine raised from the loop thread) ends every stream with a 500
error, then calls ``on_fatal(error)`` when it is set: ``python -m paged.server``
(`paged.server.cli.run_server`) sets it to stop and exit the process with status 1, so a
supervisor restarts a server whose engine died instead of it answering 503 forever.

Back-pressure: at most ``max_waiting`` requests wait (accepted by the server but not running:
commands not applied yet plus the engine's waiting queue); `submit` refuses more with a 503
ApiError instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from paged.request.outputs import OutputDeltas
from paged.server.metrics import ServerMetrics
from paged.server.protocol import ApiError

log = logging.getLogger(__name__)


@dataclass
class Stream:
    """One HTTP request's engine requests and the queue their outputs arrive on.

    ``requests``: ``(engine request id, token ids, SamplingParams)`` per prompt; the tag of each
    item is the prompt's position in this list.
    """

    requests: list[tuple[str, list[int], object]]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    timeout_s: float | None = None
    logprobs: bool = False  # deliver each choice's per-token log-probabilities too
    prompt_logprobs: bool = False  # deliver the prompt's log-probabilities too


class EngineLoop:
    """Owns ``engine`` from its own thread (see the module docstring).

    Args:
      engine: a `paged.Engine` (built, optionally warmed up); no other thread may call it.
      max_waiting: requests that may wait before `submit` answers 503.
      request_timeout_s: passed as every request's ``timeout_s`` (None: the engine's default).
      metrics: where to record gauges and latencies (a fresh `ServerMetrics` by default).
    """

    def __init__(self, engine, *, max_waiting: int = 256, request_timeout_s: float | None = None,
                 metrics: ServerMetrics | None = None, warmup: bool = False):
        self.engine = engine
        # With ``warmup`` the loop thread first compiles (``engine.warmup(progress=True)``);
        # until then ``ready`` is False and `submit` answers 503 with Retry-After.
        self._warmup = warmup
        self.ready = not warmup
        self.warmup_started: float | None = None
        self.max_waiting = max_waiting
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics or ServerMetrics()
        self._cond = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._pending = 0  # requests submitted and not yet added to the engine (under _cond)
        self._engine_waiting = 0  # the engine's waiting sequences after the last step
        self._stopping = False
        self.error: BaseException | None = None  # set if the engine raised; the loop then stops
        # Called from the loop thread with the error once the streams have theirs (see above).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._live: dict[str, tuple[Stream, int]] = {}  # loop thread only
        self._deltas = OutputDeltas()  # what each live request's stream was handed (loop thread)
        self.kv_events = None  # `paged.server.kv_publisher.KVEventPublishers`: flushed per step
        self._thread = threading.Thread(target=self._run, name="paged-engine-loop", daemon=True)
        self.num_steps = 0

    # --- called from handler threads ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        close = getattr(self.engine, "close", None)  # an engine in its own process has one
        if close is not None and not self._thread.is_alive():
            close()

    @property
    def warmup_status(self) -> str:
        if self.ready:
            return "ready"
        if self.warmup_started is None:
            return "warmup not started"
        return f"warmup running for {time.monotonic() - self.warmup_started:.0f} s"

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished (engine requests, one per prompt)."""
        return self._pending + len(self._live)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    def submit(self, stream: Stream) -> None:
        """Queues ``stream``'s requests for the engine.

        Raises:
          ApiError: 503 when ``max_waiting`` requests already wait or the loop is not running.
        """
        k = len(stream.requests)
        with self._cond:
            if not self.alive:
                raise ApiError("the engine is not running" + (
                    f": {self.error}" if self.error else ""), status=503, type="server_error",
                    code="engine_not_running")
            if not self.ready:
                raise ApiError(f"the server is still compiling ({self.warmup_status}); retry "
                               f"shortly", status=503, type="server_error", code="warming_up")
            waiting = self._pending + self._engine_waiting
            if waiting + k > self.max_waiting:
                raise ApiError(f"server busy: {waiting} requests waiting (max_waiting="
                               f"{self.max_waiting}); retry later", status=503,
                               type="server_error", code="server_busy")
            self._pending += k
            self._commands.append(("add", stream))
            self._cond.notify()

    def abort(self, request_ids: list[str]) -> None:
        """Asks the loop to abort these engine requests (unknown or finished ones are ignored)."""
        if not request_ids:
            return
        with self._cond:
            self._commands.append(("abort", list(request_ids)))
            self._cond.notify()

    # --- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            if not self.ready:
                self.warmup_started = time.monotonic()
                n = engine.warmup(progress=True)
                print(f"paged.server: ready: warmup compiled {n} step shapes in "
                      f"{time.monotonic() - self.warmup_started:.1f} s", file=sys.stderr,
                      flush=True)
                if self.kv_events is not None:
                    self.kv_events.flush()
                self.ready = True
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or engine.has_unfinished_requests()
                               or engine.has_step_in_flight()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for cmd in commands:
                    self._apply(cmd)
                if engine.has_unfinished_requests() or engine.has_step_in_flight():
                    outputs = engine.step()
                    self.num_steps += 1
                    if self.kv_events is not None:
                        self.kv_events.flush()
                    self._deliver(outputs)
                self._update_metrics()
        except BaseException as e:  # noqa: BLE001  (reported to every stream, then the loop ends)
            log.exception("engine loop failed")
            self.error = e
        finally:
            self._fail_all(ApiError(
                f"engine stopped: {self.error}" if self.error else "server shutting down",
                status=500 if self.error else 503, type="server_error",
                code="engine_error" if self.error else "shutting_down"))
            if self.error is not None and self.on_fatal is not None:
                self.on_fatal(self.error)

    def _update_metrics(self) -> None:
        with self._cond:
            pending = self._pending
        stats = self.metrics.update_engine(self.engine, pending)
        self._engine_waiting = stats["num_waiting"]

    def _apply(self, cmd) -> None:
        kind, arg = cmd
        if kind == "abort":
            for rid in arg:
                self._deltas.forget(rid)
                if self._live.pop(rid, None) is not None and self.engine.abort(rid):
                    self.metrics.aborted.inc()
            return
        stream: Stream = arg
        added = []
        try:
            for tag, (rid, token_ids, params) in enumerate(stream.requests):
                self.engine.add_request(rid, token_ids, params, timeout_s=(
                    stream.timeout_s if stream.timeout_s is not None else self.request_timeout_s))
                self._live[rid] = (stream, tag)
                added.append(rid)
        except (TypeError, ValueError) as e:
            for rid in added:
                self._live.pop(rid, None)
                self.engine.abort(rid)
            err = ApiError(str(e))
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, ("error", 0, err))
        finally:
            with self._cond:
                self._pending -= len(stream.requests)

    def _deliver(self, outputs) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        live = self._live
        for out in outputs:
            entry = live.get(out.request_id)
            if entry is None:
                continue  # aborted by its client
            stream, tag = entry
            choices = [(o.index, ids, o.finish_reason, lps,
                        o.text if isinstance(o.stop_reason, str) else None, o.stop_reason)
                       for o, ids, lps in self._deltas.take(out, stream.logprobs)]
            plps = getattr(out, "prompt_logprobs", None) if stream.prompt_logprobs else None
            finished = out.finished
            info = None
            if finished:
                del live[out.request_id]
                info = (len(out.prompt_token_ids), out.num_cached_tokens)
                self.metrics.observe_finished(out, out.finish_reason or "abort")
            batches.setdefault(stream.loop, []).append(
                (stream.queue, ("out", tag, choices, finished, info, plps)))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_fan_out, items)
            except RuntimeError:  # the event loop is closed (server shutting down)
                pass

    def _fail_all(self, err: ApiError) -> None:
        streams = {id(s): s for s, _ in self._live.values()}
        self._live.clear()
        self._deltas = OutputDeltas()
        for s in streams.values():
            try:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, ("error", 0, err))
            except RuntimeError:
                pass
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        for kind, arg in commands:
            if kind == "add":
                try:
                    arg.loop.call_soon_threadsafe(arg.queue.put_nowait, ("error", 0, err))
                except RuntimeError:
                    pass


def _fan_out(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)
