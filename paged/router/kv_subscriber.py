"""A subscriber of one replica's KV events (`paged.server.kv_publisher`): its true prefix cache.

`EventStream` is the transport-free half: it takes ``(seq, payload)`` messages in arrival order,
applies each batch once to a `paged.kv.events.KVCacheView`, and detects a gap (``seq`` jumped:
batches were missed, or the subscriber joined late). A gap is filled from the publisher's replay
buffer when one is given; if the replay cannot fill it (the batches left the buffer) the view is
marked ``lost`` (it may miss blocks: a router should not trust it) until a ``AllBlocksCleared``
batch resets it; a stream that starts over at 0 is a restarted publisher (the view is emptied).
`KVEventSubscriber` connects a SUB socket (and a DEALER for replay) to a
publisher and feeds an `EventStream`; ``poll()`` applies whatever arrived, without blocking.
"""

from __future__ import annotations

import logging

import zmq

from paged.kv.events import KVCacheView, decode_batch

log = logging.getLogger(__name__)

TOPIC = "kv-events"
_REPLAY_TIMEOUT_MS = 500


class EventStream:
    """Sequence numbers and the view of one publisher (module docstring).

    Args:
      replay: ``replay(start_seq) -> [(seq, payload), ...]`` (the publisher's kept batches from
        ``start_seq`` on), or None when there is no replay socket.
    """

    def __init__(self, replay=None):
        self.view = KVCacheView()
        self.replay = replay
        self.last_seq = -1
        self.num_batches = 0  # batches applied
        self.num_gaps = 0  # jumps seen
        self.num_replayed = 0  # batches recovered by replay
        self.lost = False  # a gap the replay could not fill: the view may miss blocks

    def receive(self, seq: int, payload: bytes) -> None:
        if seq == 0 and self.last_seq >= 0:  # the publisher restarted: its cache starts empty
            log.warning("KV events start over at 0 (the replica restarted)")
            self.reset()
        if seq <= self.last_seq:
            return  # a duplicate (seen live and replayed)
        if seq > self.last_seq + 1:
            self.num_gaps += 1
            got = self.replay(self.last_seq + 1) if self.replay is not None else []
            for s, p in got:
                if self.last_seq < s < seq:
                    if s != self.last_seq + 1:
                        break
                    self._apply(s, p)
                    self.num_replayed += 1
            if self.last_seq + 1 != seq:
                log.warning("KV events %d..%d are lost: the view may miss blocks",
                            self.last_seq + 1, seq - 1)
                self.lost = True
        self._apply(seq, payload)

    def reset(self) -> None:
        """Forgets everything (a replica that restarted has an empty cache)."""
        self.view.clear()
        self.last_seq = -1
        self.lost = False

    def _apply(self, seq: int, payload: bytes) -> None:
        _, events, _ = decode_batch(payload)
        if any(ev.get("type") == "AllBlocksCleared" for ev in events):
            self.lost = False  # everything before it no longer matters
        self.view.apply(events)
        self.last_seq = seq
        self.num_batches += 1


def replay_endpoint(endpoint: str) -> str:
    """The replay address beside a publisher's ``tcp://host:PORT``: ``tcp://host:PORT+1``."""
    base, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not base.startswith("tcp://"):
        raise ValueError(f"kv_events={endpoint!r} must be tcp://HOST:PORT")
    return f"{base}:{int(port) + 1}"


class KVEventSubscriber:
    """SUB (and replay DEALER) sockets on one publisher, feeding an `EventStream`.

    Args:
      endpoint: the publisher's PUB address, ``tcp://host:port``.
      replay_endpoint: its replay address, or None.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = TOPIC):
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._dealer = None
        if replay_endpoint is not None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(replay_endpoint)
        self.stream = EventStream(self._replay if self._dealer is not None else None)

    @property
    def view(self) -> KVCacheView:
        return self.stream.view

    def poll(self, timeout_ms: int = 0) -> int:
        """Applies every batch that has arrived (waiting up to ``timeout_ms`` for the first);
        returns how many."""
        n = 0
        while self._sub.poll(timeout_ms if n == 0 else 0):
            frames = self._sub.recv_multipart()
            if len(frames) != 3:
                log.warning("a KV event message of %d frames, skipped", len(frames))
                continue
            _, seq, payload = frames
            self.stream.receive(int.from_bytes(seq, "big"), payload)
            n += 1
        return n

    def _replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        self._dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        while self._dealer.poll(_REPLAY_TIMEOUT_MS):
            _, seq, payload = self._dealer.recv_multipart()
            s = int.from_bytes(seq, "big", signed=True)
            if s < 0:
                break
            out.append((s, payload))
        return out

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)


__all__ = ["TOPIC", "EventStream", "KVEventSubscriber", "replay_endpoint"]
