"""`EngineCoreClient`: the server's handle on an engine stepping in its own process.

It offers what the server uses of an `Engine` (``config``, ``model_config``, ``tokenizer``,
``add_request``, ``abort``, ``step``, ``has_unfinished_requests``, ``has_step_in_flight``,
``kv_stats``, ``warmup``) so `EngineLoop` and the app run unchanged over either. Differences:

- ``add_request`` runs the engine's own checks here (`paged.request.checks.check_request`, on
  the configs and tokenizer the core handed over), so a bad request raises before anything is
  sent, as in process; the add itself is asynchronous.
- ``step()`` does not step: the core steps on its own. It returns the outputs of every step the
  core finished since the last call (waiting at most ``poll_ms`` for the next one), merged per
  request, as `RemoteOutput` objects with the attributes the server reads.
- ``kv_stats()`` holds only the gauges of `paged.server.wire.STAT_KEYS`, as of the core's last
  step.
- ``close()`` stops the process (`EngineLoop.stop` calls it).

Only one thread may call it (the `EngineLoop` thread), as for an engine.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import pickle
import tempfile
import time

import zmq

from paged.request.checks import check_request
from paged.server import wire
from paged.server.core_process import run_core

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 600.0  # building the engine (loading a checkpoint) may take minutes
_ids = itertools.count()


class RemoteCompletion:
    """One sample of a `RemoteOutput` (cumulative, as `paged.request.outputs.CompletionOutput`).

    Its token ids and log-probabilities live in append-only lists that the sample's later
    snapshots share; each snapshot reads them up to its own count, so taking one copies nothing.
    """

    __slots__ = ("index", "finish_reason", "stop_reason", "text", "_ids", "_lps", "_end")

    def __init__(self, index: int, ids: list[int] | None = None, lps: list | None = None,
                 end: int = 0):
        self.index = index
        self.finish_reason = None
        self.stop_reason = None
        self.text = None
        self._ids: list[int] = [] if ids is None else ids
        self._lps = lps
        self._end = end

    def extend(self, new_ids: list[int], new_lps: list | None) -> None:
        self._ids.extend(new_ids)
        if new_lps is not None:
            if self._lps is None:
                self._lps = []
            self._lps.extend(new_lps)
        self._end = len(self._ids)

    def copy(self) -> RemoteCompletion:
        """A snapshot: later ``extend`` calls do not change what it reads."""
        c = RemoteCompletion(self.index, self._ids, self._lps, self._end)
        c.finish_reason, c.stop_reason, c.text = self.finish_reason, self.stop_reason, self.text
        return c

    @property
    def token_ids(self) -> list[int]:
        return self._ids[:self._end]

    @property
    def logprobs(self) -> list | None:
        return None if self._lps is None else self._lps[:self._end]

    @property
    def num_token_ids(self) -> int:
        return self._end

    def token_ids_from(self, k: int) -> list[int]:
        return self._ids[k:self._end]

    def logprobs_from(self, k: int) -> list | None:
        return None if self._lps is None else self._lps[k:self._end]


class RemoteOutput:
    """A request's state as of the core's latest step (cumulative token ids per sample)."""

    __slots__ = ("request_id", "prompt_token_ids", "finished", "finish_reason", "finish_time",
                 "arrival_time", "first_token_time", "num_cached_tokens", "num_preemptions",
                 "num_host_cached_tokens", "prompt_logprobs", "_samples")

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.finished = False
        self.finish_reason = self.finish_time = self.arrival_time = None
        self.first_token_time = None
        self.num_cached_tokens = self.num_preemptions = self.num_host_cached_tokens = 0
        self.prompt_logprobs = None
        self._samples: dict[int, RemoteCompletion] = {}

    def update(self, msg: list) -> None:
        (_, self.finished, self.finish_reason, self.finish_time, self.arrival_time,
         self.first_token_time, self.num_cached_tokens, self.num_preemptions,
         self.num_host_cached_tokens, samples, plps) = msg
        if plps is not None:
            self.prompt_logprobs = plps
        for index, new_ids, reason, new_lps, stop_reason, text in samples:
            s = self._samples.get(index)
            if s is None:
                s = self._samples[index] = RemoteCompletion(index)
            s.extend(new_ids, new_lps)  # earlier snapshots read only up to their own count
            s.finish_reason, s.stop_reason, s.text = reason, stop_reason, text

    @property
    def outputs(self) -> list[RemoteCompletion]:
        return [self._samples[i] for i in sorted(self._samples)]

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self._samples else []

    def snapshot(self) -> RemoteOutput:
        """A copy whose samples no later update changes (the server reads outputs later)."""
        c = RemoteOutput(self.request_id, self.prompt_token_ids)
        for name in RemoteOutput.__slots__[2:-1]:
            setattr(c, name, getattr(self, name))
        c._samples = {i: s.copy() for i, s in self._samples.items()}
        return c


class _Table:
    """What `check_request` reads, over the client's own request table."""

    def __init__(self, client: EngineCoreClient):
        self._client = client
        self.config = client.config
        self.tokenizer = client.tokenizer
        self.vocab_size = client.model_config.vocab_size
        self.cache_salt = b""  # the core adds the model's own salt; only the checks run here

    def has_request(self, request_id: str) -> bool:
        return self._client.has_request(request_id)


class EngineCoreClient:
    """Starts the engine ``config`` describes in a child process and talks to it.

    Args:
      config: the `EngineConfig` (``random-small`` works as for ``make_engine``).
      poll_ms: how long ``step()`` waits for the core's next step before returning nothing (the
        server's loop then applies new commands and calls it again).
      replica: ``(i, D)``: the core is replica ``i`` of ``D`` (`paged.server.core_replicas`).
      kv_events: the port the core publishes its KV events on (`paged.server.kv_publisher`).

    Raises:
      RuntimeError: the core could not build the engine (its message), or did not answer.
    """

    def __init__(self, config, *, poll_ms: float = 5.0, replica: tuple[int, int] | None = None,
                 kv_events: int | None = None):
        self._poll_ms = poll_ms
        self._ctx = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="paged-core-")
        name = f"{os.getpid()}-{next(_ids)}"
        cmd_addr = f"ipc://{self._dir}/cmd-{name}"
        out_addr = f"ipc://{self._dir}/out-{name}"
        self._cmds = self._ctx.socket(zmq.PUSH)
        self._cmds.setsockopt(zmq.LINGER, 0)
        self._cmds.bind(cmd_addr)
        self._outs = self._ctx.socket(zmq.PULL)
        self._outs.bind(out_addr)
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_core, args=(config, cmd_addr, out_addr, replica, kv_events),
            name="paged-engine-core",
            daemon=True)
        self._proc.start()
        self._live: dict[str, RemoteOutput] = {}
        self._stats = dict.fromkeys(wire.STAT_KEYS, 0)
        self._core_busy = False  # the core may still step: an abort sent, or work at its last step
        self._closed = False
        try:
            hello = self._recv_startup()
        except BaseException:
            self.close()
            raise
        _, self.config, self.model_config, self.tokenizer = hello
        self._table = _Table(self)

    def _recv_startup(self):
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._outs.poll(1000):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine-core process exited with code "
                                   f"{self._proc.exitcode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine-core process did not start in "
                                   f"{_START_TIMEOUT_S:.0f} s")
        msg = pickle.loads(self._outs.recv())
        if msg[0] == "failed":
            raise RuntimeError(f"the engine-core process could not build the engine: {msg[1]}")
        return msg

    @property
    def outputs_socket(self) -> zmq.Socket:
        """The socket the core's messages arrive on (to wait on several cores at once)."""
        return self._outs

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    @property
    def pid(self) -> int | None:
        """The engine-core process's id."""
        return self._proc.pid

    # --- the engine's interface, as the server uses it -------------------------------------------
    def has_request(self, request_id: str) -> bool:
        return request_id in self._live

    def add_request(self, request_id, prompt, params=None, *, timeout_s=None) -> None:
        """Checks as ``Engine.add_request`` does (raising TypeError / ValueError before anything
        is sent), then queues the request in the core."""
        self.add_checked(*self.check(request_id, prompt, params, timeout_s))

    def check(self, request_id, prompt, params=None, timeout_s=None) -> tuple:
        """``Engine.add_request``'s checks, no side effect: ``(request id, token ids, params,
        timeout)`` for `add_checked`, or TypeError / ValueError."""
        rid, token_ids, params, _, timeout_s, _ = check_request(
            self._table, request_id, prompt, params, None, timeout_s, None)
        return rid, list(token_ids), params, timeout_s

    def add_checked(self, request_id: str, token_ids: list[int], params, timeout_s) -> None:
        """Queues a request that `check` passed."""
        self._cmds.send(wire.pack(["add", request_id, token_ids, wire.params_to_wire(params),
                                   timeout_s]))
        self._live[request_id] = RemoteOutput(request_id, token_ids)

    def abort(self, request_id: str) -> bool:
        """True if the request was unfinished here (the core aborts it on its next command
        read; its final output is not reported)."""
        if self._live.pop(request_id, None) is None:
            return False
        self._cmds.send(wire.pack(["abort", [request_id]]))
        self._core_busy = True  # its step reporting the abort updates the gauges
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def has_step_in_flight(self) -> bool:
        """Whether the core may still step: a request unfinished, or an abort whose step has
        not been reported yet (so ``kv_stats()`` catches up with it)."""
        return bool(self._live) or self._core_busy

    def kv_stats(self) -> dict:
        return dict(self._stats)

    def warmup(self, *, progress: bool = False) -> int:
        """The core compiles every step shape (``Engine.warmup``); returns the compilations."""
        self._cmds.send(wire.pack(["warmup"]))
        while True:
            msg = self._recv(None)
            if msg[0] == "warm":
                return msg[1]
            self._handle(msg, {})

    def step(self, timeout_ms: float | None = None) -> list[RemoteOutput]:
        """The outputs of the core's steps since the last call (one per changed request), after
        waiting up to ``timeout_ms`` (default ``poll_ms``) for the first."""
        changed: dict[str, RemoteOutput] = {}
        msg = self._recv(self._poll_ms if timeout_ms is None else timeout_ms)
        while msg is not None:
            self._handle(msg, changed)
            msg = self._recv(0)
        return [o.snapshot() for o in changed.values()]

    def close(self, timeout: float = 10.0) -> None:
        """Stops the core (asks, then terminates it after ``timeout``) and frees the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._proc.is_alive():
            try:
                self._cmds.send(wire.pack(["stop"]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        self._cmds.close(linger=0)
        self._outs.close(linger=0)
        self._ctx.term()
        for f in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, f))
        os.rmdir(self._dir)

    # --- messages -------------------------------------------------------------------------------
    def _recv(self, timeout_ms: float | None):
        """The next message, or None after ``timeout_ms`` (None: wait; the core's death raises)."""
        while True:
            wait = 1000 if timeout_ms is None else timeout_ms
            if self._outs.poll(wait):
                return wire.unpack(self._outs.recv())
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine-core process exited (code {self._proc.exitcode})")
            if timeout_ms is not None:
                return None

    def _handle(self, msg, changed: dict) -> None:
        kind = msg[0]
        if kind == "step":
            _, outputs, stats = msg
            self._stats = s = dict(zip(wire.STAT_KEYS, stats))
            self._core_busy = s["num_running"] + s["num_waiting"] > 0
            live = self._live
            for o in outputs:
                rid = o[0]
                out = live.get(rid)
                if out is None:
                    continue  # aborted here
                out.update(o)
                changed[rid] = out
                if out.finished:
                    del live[rid]
        elif kind == "rejected":
            _, rid, message = msg
            log.error("the engine core refused request %r that passed the server's checks: %s",
                      rid, message)
            out = self._live.pop(rid, None)
            if out is not None:
                out.finished, out.finish_reason = True, "abort"
                out.finish_time = time.perf_counter()
                changed[rid] = out
        elif kind == "error":
            raise RuntimeError(f"engine core failed: {msg[1]}")
        else:
            raise RuntimeError(f"unexpected message from the engine core: {kind!r}")
