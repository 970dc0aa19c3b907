"""Data-parallel replicas whose host half runs in a process of its own, in lockstep.

``DataParallelEngine`` (``paged.engine.data_parallel``) steps its D replicas from one Python
thread: every replica's scheduling, batch build and read-back run one after the other, so the
host time of a step grows with D. `ProcessReplica` is a ``replica_factory`` that builds each
replica's ``Engine`` in a child process (spawned; replica ``i`` on the devices in-process replica
``i`` would get) and drives it by messages: ``dispatch_step`` sends "step" and returns at once,
``finish_step`` receives that step's outputs, so the D host halves run at the same time on D
cores while ``DataParallelEngine.step`` keeps its contract (one step of every replica per call,
outputs grouped by replica). Routing, seeds, request ids and ``record_steps`` are those of the
in-process engine, so the same requests give the same tokens and the same batches.

``process_replicas(config, ...)`` builds such an engine; ``Engine(config)`` stays in-process
(the default). What differs from in-process replicas:

- outputs are `paged.server.core_client.RemoteOutput` objects (request id, cumulative token ids
  and log-probabilities per sample, finish reasons, timings: what the server's wire carries),
  sent as deltas (`paged.server.wire.DeltaEncoder`);
- the router reads each replica's queue sizes and prefix-cache hits by asking its process (the
  loads are kept until the replica changes; no digest is shared between replicas);
- ``replicas[i]`` is the `ProcessReplica`, not an ``Engine``: its block manager, cache and
  scheduler live in the child (``kv_stats()`` reports them);
- pairs the support matrix refuses for engine-core processes are refused here too (prefill
  replicas: the hand-over moves device arrays within one process).

Each child costs a Python and JAX start and its own compilations (seconds), and every message a
pickle round trip (tens of microseconds); it pays where a replica's host step is long.
"""

from __future__ import annotations

import multiprocessing
import types

from paged.config.support import check_supported
from paged.server import wire
from paged.server.core_client import RemoteOutput
from paged.workload.metrics import StepTiming

_TIMING = ("schedule", "prepare", "device", "postprocess", "num_seqs", "num_tokens")


def process_replicas(config, *, model_config=None, params=None, devices=None):
    """A ``DataParallelEngine`` of ``config.data_parallel_size`` replicas, each stepping in its
    own process (module docstring). Raises ValueError for a pair engine-core processes refuse."""
    from paged.engine.data_parallel import DataParallelEngine

    check_supported(config, engine_processes=True)
    return DataParallelEngine(config, replica_factory=ProcessReplica, model_config=model_config,
                              params=params, devices=devices)


class _Pending:
    """``dispatch_step``'s handle: ``launched`` is known once ``finish_step`` has read the
    replica's answer (``DataParallelEngine.step`` reads it after)."""

    __slots__ = ("launched",)

    def __init__(self):
        self.launched = None


class ProcessReplica:
    """One replica ``Engine`` in a child process (see the module docstring).

    Args (``DataParallelEngine``'s ``replica_factory`` signature):
      config: the one-replica ``EngineConfig``.
      model_config, params: the model (the params are copied to the child once).
      devices: the replica's devices (the child picks the devices of the same ids).
    """

    def __init__(self, config, *, model_config, params, devices):
        import jax

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(child, config, model_config, jax.device_get(params),
                                 [d.id for d in devices]),
            name="paged-replica", daemon=True)
        self._proc.start()
        child.close()
        self.config = config
        (self.model_config, self.tokenizer, self.page_size, self.cache_salt,
         self._flags) = self._answer()
        self._live: dict[str, RemoteOutput] = {}
        self._loads: tuple[int, int] | None = None  # (waiting, running) until the next change
        self.last_timing = StepTiming()
        self.step_record: list[dict] | None = None
        self._stepping = False

    # --- messages -----------------------------------------------------------------------
    def _answer(self):
        msg = self._conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"replica process failed: {msg[1]}")
        return msg[1]

    def _call(self, name: str, *args, **kwargs):
        self._conn.send(("call", name, args, kwargs))
        return self._answer()

    def _changed(self) -> None:
        self._loads = None

    # --- the replica protocol DataParallelEngine drives ------------------------------------
    def add_checked(self, checked: tuple, *, seed=None) -> None:
        self._conn.send(("add", checked, seed))
        self._live[checked[0]] = RemoteOutput(checked[0], list(checked[1]))
        self._flags = (True, self._flags[1])
        self._changed()

    def abort(self, request_id: str) -> bool:
        self._changed()
        ok, self._flags = self._call("abort", request_id)
        return ok

    def dispatch_step(self) -> _Pending:
        if self._stepping:
            raise RuntimeError("dispatch_step() twice without finish_step()")
        self._conn.send(("step",))
        self._stepping = True
        return _Pending()

    def finish_step(self, pending: _Pending) -> list:
        if not self._stepping:
            raise RuntimeError("finish_step() without dispatch_step()")
        self._stepping = False
        self._changed()
        launched, outputs, timing, self._flags, records = self._answer()
        pending.launched = launched or None
        self.last_timing = StepTiming(*timing)
        if records and self.step_record is not None:
            self.step_record += records
        changed = {}
        for o in outputs:
            out = self._live.get(o[0])
            if out is None:
                continue
            out.update(o)
            changed[o[0]] = out
            if out.finished:
                del self._live[o[0]]
        return [o.snapshot() for o in changed.values()]

    def has_unfinished_requests(self) -> bool:
        return self._flags[0]

    def has_step_in_flight(self) -> bool:
        return self._flags[1]

    def unfinished_request_ids(self) -> list[str]:
        return self._call("unfinished_request_ids")

    def set_device_step(self, fn=None) -> None:
        """``Engine.set_device_step`` in the child: ``fn`` must pickle (a module-level function,
        such as ``paged.engine.device_step.stub_step``)."""
        self._call("set_device_step", fn)

    def record_steps(self) -> list[dict]:
        self._call("record_steps")
        self.step_record = []
        return self.step_record

    def reset_prefix_cache(self) -> bool:
        self._changed()
        return self._call("reset_prefix_cache")

    def warmup(self, **kwargs) -> int:
        return self._call("warmup", **kwargs)

    def trace_count(self) -> int:
        return self._call("trace_count")

    def kv_stats(self, *, held_for_transfer=()) -> dict:
        return self._call("kv_stats")

    @property
    def speculator(self):
        """The child's speculation counters as ``speculator.stats`` (None without speculation)."""
        stats = self._call("spec_stats")
        return None if stats is None else types.SimpleNamespace(stats=stats)

    @property
    def block_manager(self):
        """What ``DataParallelEngine`` reads of a replica's block manager (host-tier blocks)."""
        return types.SimpleNamespace(num_host_tier_blocks=self._call("num_host_tier_blocks"))

    # --- what the router reads (paged.fleet.routing.Replica) ----------------------------------
    def _load(self) -> tuple[int, int]:
        if self._loads is None:
            self._loads = self._call("loads")
        return self._loads

    @property
    def num_waiting(self) -> int:
        return self._load()[0]

    @property
    def num_running(self) -> int:
        return self._load()[1]

    def cached_prefix_tokens(self, token_ids, cache_salt=None, probe=None) -> int:
        return self._call("cached_prefix_tokens", list(token_ids), cache_salt)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the child (asks, then terminates it after ``timeout``)."""
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        self._conn.close()

    def __del__(self):
        try:
            self.close(1.0)
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


# --- the child ------------------------------------------------------------------------------
def _serve(conn, config, model_config, params, device_ids) -> None:
    """The child's whole life: build the engine, answer "hello", then serve messages in order."""
    try:
        import jax

        from paged.engine.engine import Engine

        by_id = {d.id: d for d in jax.devices()}
        engine = Engine(config, model_config=model_config, params=params,
                        devices=[by_id[i] for i in device_ids])
    except BaseException as e:  # noqa: BLE001  (reported to the parent)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (engine.model_config, engine.tokenizer, engine.page_size, engine.cache_salt,
                      _flags(engine))))
    encoder = wire.DeltaEncoder()
    calls = _calls(engine)
    sent = 0  # step records sent so far
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return  # the parent is gone
        kind = msg[0]
        try:
            if kind == "step":
                pending = engine.dispatch_step()
                launched = pending.launched is not None
                outputs = engine.finish_step(pending)
                t, recs = engine.last_timing, engine.step_record
                new = None if recs is None else recs[sent:]  # what this step recorded
                sent = 0 if recs is None else len(recs)
                conn.send(("ok", (launched, [encoder.encode(o) for o in outputs],
                                  [getattr(t, f) for f in _TIMING], _flags(engine), new)))
            elif kind == "add":
                _, checked, seed = msg
                engine.add_checked(checked, seed=seed)
            elif kind == "call":
                _, name, args, kwargs = msg
                if name == "record_steps":
                    sent = 0
                conn.send(("ok", calls[name](*args, **kwargs)))
            elif kind == "stop":
                return
        except BaseException as e:  # noqa: BLE001  (the parent raises it)
            conn.send(("error", f"{type(e).__name__}: {e}"))
            return


def _flags(engine) -> tuple[bool, bool]:
    return engine.has_unfinished_requests(), engine.has_step_in_flight()


def _calls(engine) -> dict:
    from paged.fleet.routing import cached_prefix_tokens

    def abort(request_id):
        return engine.abort(request_id), _flags(engine)

    def spec_stats():
        return None if engine.speculator is None else engine.speculator.stats

    return {
        "abort": abort,
        "unfinished_request_ids": engine.unfinished_request_ids,
        "set_device_step": engine.set_device_step,
        "record_steps": lambda: len(engine.record_steps()),
        "reset_prefix_cache": engine.reset_prefix_cache,
        "warmup": engine.warmup,
        "trace_count": engine.trace_count,
        "kv_stats": engine.kv_stats,
        "spec_stats": spec_stats,
        "num_host_tier_blocks": lambda: engine.block_manager.num_host_tier_blocks,
        "loads": lambda: (engine.core.num_waiting, engine.core.num_running),
        "cached_prefix_tokens": lambda ids, salt: cached_prefix_tokens(
            engine.block_manager, ids, salt),
    }


__all__ = ["ProcessReplica", "process_replicas"]
