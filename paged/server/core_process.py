"""The engine-core process: one `Engine` stepping in its own process (``--engine_process``).

As in vLLM V1 (API server and EngineCore), the HTTP server's event loop and the engine's host
work no longer share one GIL. `run_core` is the child's whole life: build the engine, hand the
server its config and tokenizer (pickled, once), then loop:

1. take every command that arrived (block on the socket only when there is no work);
2. step while the engine has unfinished requests or a step in flight;
3. send the step's outputs as deltas plus the gauges the server's metrics need (`paged.server.wire`).

It stops on ``["stop"]``, when the server's end of the socket goes away for good (it checks that
its parent is alive every second while idle), or after an engine error, which it reports first
(then with exit status 1).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import traceback

import zmq

from paged.server import wire

log = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # while idle: wake this often to see whether the server is still there


def run_core(config, cmd_addr: str, out_addr: str, replica: tuple[int, int] | None = None,
             kv_events: int | None = None) -> None:
    """The child's entry point (``multiprocessing`` spawn target).

    ``replica``: ``(i, D)`` when this core is replica ``i`` of ``config.data_parallel_size = D``:
    it builds a one-replica engine on the ``i``-th group of ``tensor_parallel_size`` devices of
    ``jax.devices()`` (`paged.engine.placement.split_devices`, as in-process replicas are placed).
    ``kv_events``: the server's ``--kv_events`` port: this core publishes its KV events
    (`paged.server.kv_publisher`, replica ``i`` on ``PORT + 2 i``).
    """
    ctx = zmq.Context()
    cmds = ctx.socket(zmq.PULL)
    cmds.connect(cmd_addr)
    outs = ctx.socket(zmq.PUSH)
    outs.setsockopt(zmq.LINGER, 2000)
    outs.connect(out_addr)
    parent = os.getppid()
    try:
        from paged.server.engines import make_engine

        engine = make_engine(config, replica=replica)
        pubs = None
        if kv_events is not None:
            from paged.server.kv_publisher import attach_publishers

            pubs = attach_publishers(engine, kv_events, rank=0 if replica is None else replica[0])
    except BaseException as e:  # noqa: BLE001  (the server reports it and exits)
        outs.send(pickle.dumps(("failed", f"{type(e).__name__}: {e}")))
        cmds.close(linger=0)  # an open socket makes ctx.term() wait forever
        outs.close()
        ctx.term()
        return
    outs.send(pickle.dumps(("hello", engine.config, engine.model_config, engine.tokenizer)))
    failed = False
    try:
        _loop(engine, cmds, outs, parent, pubs)
    except BaseException as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        outs.send(wire.pack(["error", f"{type(e).__name__}: {e}"]))
        failed = True
    finally:
        if pubs is not None:
            pubs.close()
        cmds.close(linger=0)
        outs.close()
        ctx.term()
    if failed:
        sys.exit(1)  # the core's exit status says it failed (the server exits 1 as well)


def _loop(engine, cmds, outs, parent: int, pubs=None) -> None:
    encoder = wire.DeltaEncoder()
    pack = wire.pack
    while True:
        busy = engine.has_unfinished_requests() or engine.has_step_in_flight()
        if busy:
            ready = cmds.poll(0)
        else:
            ready = cmds.poll(_IDLE_POLL_MS)
            if not ready and os.getppid() != parent:
                return  # the server is gone
        while ready:
            msg = wire.unpack(cmds.recv())
            if not _apply(engine, msg, outs, encoder):
                return
            ready = cmds.poll(0)
        if engine.has_unfinished_requests() or engine.has_step_in_flight():
            outputs = engine.step()
            if pubs is not None:
                pubs.flush()
            s = engine.kv_stats()
            outs.send(pack(["step", [encoder.encode(o) for o in outputs],
                            [s[k] for k in wire.STAT_KEYS]]))


def _apply(engine, msg, outs, encoder) -> bool:
    kind = msg[0]
    if kind == "add":
        _, rid, token_ids, params, timeout_s = msg
        try:
            engine.add_request(rid, token_ids, wire.params_from_wire(params), timeout_s=timeout_s)
        except (TypeError, ValueError) as e:
            outs.send(wire.pack(["rejected", rid, str(e)]))
    elif kind == "abort":
        for rid in msg[1]:
            engine.abort(rid)
    elif kind == "warmup":
        outs.send(wire.pack(["warm", engine.warmup(progress=True)]))
    elif kind == "stop":
        return False
    else:
        raise ValueError(f"unknown command {kind!r}")
    return True
