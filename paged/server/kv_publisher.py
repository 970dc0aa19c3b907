"""KV events on ZeroMQ (``python -m paged.server --kv_events PORT``), as vLLM publishes them.

`KVEventPublisher` is vLLM's ``ZmqEventPublisher``: a PUB socket sends each `KVEventBatch`
(`paged.kv.events.encode_batch`) as the three frames ``(topic, seq, payload)``, ``seq`` an 8-byte
big-endian sequence number that grows by one per batch, so a subscriber that sees ``seq`` jump
knows it missed batches; the last ``buffer_steps`` batches are kept, and a ROUTER socket replays
them: a request ``(identity, b"", start_seq)`` gets every kept batch from ``start_seq`` on as
``(identity, b"", seq, payload)``, then ``(identity, b"", -1, b"")``. One thread owns both
sockets; ``publish`` only queues. Both sockets bind 127.0.0.1 only.

`attach_publishers` wires one engine (in process: each data-parallel replica) or one engine-core
process to publishers: replica ``i`` of ``D`` publishes on ``PORT + 2 i`` and replays on
``PORT + 2 i + 1``, each batch naming its ``data_parallel_rank``. The engine loop calls
``flush()`` after each step: one batch per replica whose cache changed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import zmq

from paged.kv.events import KVEventSink, encode_batch

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
TOPIC = "kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """PUB + replay ROUTER on 127.0.0.1 (module docstring).

    Args:
      port: the PUB socket's port (0: any free port; ``port`` then says which).
      replay_port: the replay socket's port (0: any free port), or None for none.
      data_parallel_rank: written into every batch.
      buffer_steps: batches kept for replay.
    """

    def __init__(self, port: int, replay_port: int | None = None, *, data_parallel_rank: int = 0,
                 buffer_steps: int = 10_000, topic: str = TOPIC):
        for name, p in (("port", port), ("replay_port", replay_port)):
            if p is not None and (isinstance(p, bool) or not isinstance(p, int)
                                  or not 0 <= p <= 65535):
                raise ValueError(f"{name}={p!r} must be a port number in [0, 65535]")
        self.rank = data_parallel_rank
        self.topic = topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        self.port = _bind(self._pub, port)
        self._replay = None
        self.replay_port = None
        if replay_port is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_port = _bind(self._replay, replay_port)
        self.endpoint = f"tcp://{HOST}:{self.port}"
        self.replay_endpoint = None if self.replay_port is None else \
            f"tcp://{HOST}:{self.replay_port}"
        # The addresses the sockets are bound to, as ZeroMQ reports them.
        self.bound = [s.getsockopt_string(zmq.LAST_ENDPOINT)
                      for s in (self._pub, self._replay) if s is not None]
        self._queue: queue.Queue = queue.Queue()
        self._buffer: list[tuple[int, bytes]] = []
        self._buffer_steps = buffer_steps
        self.num_published = 0  # batches sent (the next sequence number)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="paged-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[dict], ts: float | None = None) -> None:
        """Queues one batch (sent by the publisher thread, in order)."""
        if not self._running:
            raise RuntimeError("the KV event publisher is closed")
        self._queue.put(encode_batch(time.time() if ts is None else ts, events, self.rank))

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued, then closes both sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    payload = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                if payload is None:
                    break
                seq = self.num_published
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                if len(self._buffer) > self._buffer_steps:
                    del self._buffer[:len(self._buffer) - self._buffer_steps]
                self.num_published += 1
        except Exception:  # noqa: BLE001  (a dead publisher must not take the server down)
            log.exception("the KV event publisher failed")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid KV event replay request: %d frames", len(frames))
            return
        ident, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((ident, b"", END_SEQ, b""))


def _bind(sock, port: int) -> int:
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{HOST}")
    sock.bind(f"tcp://{HOST}:{port}")
    return port


class KVEventPublishers:
    """One sink and one publisher per replica; ``flush()`` after each step (module docstring)."""

    def __init__(self, pairs: list[tuple[KVEventSink, KVEventPublisher]]):
        self.pairs = pairs

    def flush(self) -> None:
        for sink, pub in self.pairs:
            events = sink.take()
            if events:
                pub.publish(events)

    def close(self) -> None:
        self.flush()
        for _, pub in self.pairs:
            pub.close()


def attach_publishers(engine, port: int, *, rank: int = 0) -> KVEventPublishers:
    """Publishers for ``engine``'s block managers: an in-process engine's replicas (ranks
    ``0 .. D-1``), or, in an engine-core process, the one replica ``rank``.

    Raises:
      ValueError: a port out of range (``PORT + 2 D - 1`` must be a port).
    """
    replicas = list(getattr(engine, "replicas", None) or [engine])
    first = rank if len(replicas) == 1 else 0
    last = first + len(replicas) - 1
    if isinstance(port, bool) or not isinstance(port, int) or port < 1 \
            or port + 2 * last + 1 > 65535:
        raise ValueError(f"kv_events={port!r}: replica {last} needs ports {port + 2 * last} and "
                         f"{port + 2 * last + 1}; give a port in [1, {65534 - 2 * last}]")
    pairs = []
    try:
        for i, replica in enumerate(replicas, start=first):
            sink = KVEventSink()
            pub = KVEventPublisher(port + 2 * i, port + 2 * i + 1, data_parallel_rank=i)
            replica.block_manager.set_event_sink(sink)
            pairs.append((sink, pub))
    except BaseException:
        for _, pub in pairs:
            pub.close()
        raise
    return KVEventPublishers(pairs)


__all__ = ["END_SEQ", "HOST", "TOPIC", "KVEventPublisher", "KVEventPublishers",
           "attach_publishers"]
