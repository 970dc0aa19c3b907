"""Prefill/decode disaggregation: the one hand-over protocol, for the engine and the simulator.

With P prefill replicas and D - P decode replicas (``EngineConfig(data_parallel_size=D,
prefill_replicas=P)``; ``paged.engine.data_parallel`` or ``paged.sim.disagg``), a request computes
its prompt and samples its first token on a prefill replica, then moves:

1. **park** (``HostCore.park_prefilled``, at the prefill replica's step end): its sequences leave
   the prefill scheduler (status ``TRANSFER``: no row, never scheduled, preempted or decoded
   there) and keep their blocks; it joins one FIFO queue. Abort and timeout work as before.
2. **place** (one rule, ``HandOver.place``): in FIFO order, no overtaking, on a decode replica
   with nothing waiting or swapped out, room for the request's sequences under ``max_num_seqs``
   (hand-overs in flight to it included) and ``BlockManager.can_allocate`` of its prompt; among
   those the decode-side ``Router`` chooses (load, and prefix hits in the decode replicas'
   caches). When none fits the head, it and everything behind it wait, holding their blocks.
3. **reserve** (``HostCore.reserve_received``, all or nothing): the decode replica allocates the
   prompt's blocks (its own prefix-cache hits are reused: only the other pages travel).
4. **transfer**: the request leaves the prefill table (``HostCore.release_request``; its blocks
   there stay held under the old sequence ids) and a transport moves the pages: the device copy
   (``paged.fleet.device_transport``: gather, ``device_put``, scatter) or a priced link
   (``paged.sim.disagg`` with ``paged.sim.link_transport``).
5. **start** (``HostCore.start_received``): the blocks count as computed and the request runs on
   the decode replica. The device transport starts it at dispatch (the decode step that reads the
   pages is ordered after the scatter); the link starts it when the copy ends. When the pages
   have landed the prefill replica's held blocks are freed.

Or **abandon**: a request aborted or timed out while parked is dropped from the queue (its blocks
were freed by the prefill replica); one aborted in flight (the link only) frees both sides'
blocks when the copy ends (``HostCore.release_received`` on the decode side).

Why no deadlock: a decode replica receives nothing but hand-overs, and takes one only with
nothing waiting and blocks to spare, so what runs there finishes and frees room; the queue is
FIFO, so the oldest parked request gets the first room that fits it. The limit: head-of-line
blocking, and parked requests keep their blocks on the prefill side.

A transport has ``nbytes(num_tokens, page_size)`` (the KV bytes of that many tokens),
``starts_on_dispatch``, and ``send(flight, src, dst, src_pages, dst_pages, now)``, which returns
the bytes of the arrays it moves and arranges for ``HandOver.land(flight, now)`` once they landed
(the device transport through ``landed()``, polled at every ``run``; the link through an event).
"""

from __future__ import annotations

import collections
import dataclasses
import time

from paged.fleet.routing import EngineReplica, Router


@dataclasses.dataclass
class HandOverRecord:
    """One hand-over (the engine's and the simulator's).

    Attributes:
      request_id: the request moved.
      source, dest: replica indices (prefill, decode).
      num_tokens: prompt tokens whose KV the prefill replica computed.
      hit_tokens: of those, held by the decode replica's prefix cache (not sent).
      num_pages: pages sent (``ceil((num_tokens - hit_tokens) / block_size)``).
      bytes: KV bytes of the tokens sent, ``M_KV = 2 L n h_kv d_h b`` with ``n = num_tokens -
        hit_tokens`` (plus the scales of a quantized cache): ``accounting.kv_bytes``.
      wire_bytes: bytes of the arrays moved (the device copy: whole pages, padded to a power of
        two; the link: ``bytes``).
      ready_s: when it was parked (first token known); the engine's clock is
        ``time.perf_counter()``, the simulator's simulated seconds.
      start_s: when the transfer was dispatched (the link: when the link took it).
      end_s: when the moved pages were ready on the destination; ``None`` until then.
      aborted: abandoned in flight (or cut by the simulator's time limit).
    """

    request_id: str
    source: int
    dest: int
    num_tokens: int
    hit_tokens: int
    num_pages: int
    bytes: int
    wire_bytes: int
    ready_s: float
    start_s: float
    end_s: float | None = None
    aborted: bool = False

    @property
    def dispatched(self) -> float:
        return self.start_s

    @property
    def seconds(self) -> float | None:
        """From dispatch until the pages were ready on the destination."""
        return None if self.end_s is None else self.end_s - self.start_s

    @property
    def wait_s(self) -> float:
        """From parking until dispatch (waiting for decode-side room, or for the link)."""
        return self.start_s - self.ready_s

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "wait_s": self.wait_s, "transfer_s": self.seconds}


@dataclasses.dataclass
class Flight:
    """A hand-over between dispatch and landing."""

    record: HandOverRecord
    seqs: list  # all the request's sequences (the moving ones under the decode replica's ids)
    old_ids: list  # their ids on the source, whose blocks are still held there
    started: bool = False
    token: object = None  # the transport's own handle


class HandOver:
    """Parks prefilled requests, places them on decode replicas and moves their pages.

    Args:
      replicas: every replica (``paged.engine.engine.Engine`` or ``paged.sim.replica.SimReplica``:
        ``core``, ``block_manager``, ``config``, ``page_size``), in index order.
      roles: ``"prefill"`` or ``"decode"`` per replica.
      router: the decode-side ``paged.fleet.routing.Router``.
      spec: the model's ``accounting.ModelSpec``: the engine's device transport is built from it
        (``paged.fleet.device_transport``); give ``transport`` instead for another.
      transport: moves the pages (module docstring).
      views: what the router reads of each decode replica (default ``EngineReplica`` of each).
      prepare: called with a decode replica's index before its pool or prefix cache is read (the
        simulator applies a planned stretch up to now).

    Attributes:
      records: one ``HandOverRecord`` per hand-over, in order.
      sent_bytes, received_bytes, wire_bytes: per replica, ``bytes`` (``wire_bytes``) sent by a
        prefill replica or received by a decode replica (counted at dispatch).
      num_handovers: per replica, hand-overs sent or received.
    """

    def __init__(self, replicas: list, roles: list[str], router: Router, spec=None, *,
                 transport=None, views=None, prepare=None):
        if transport is None:
            from paged.fleet.device_transport import DeviceTransport

            transport = DeviceTransport(spec)
        self.replicas = replicas
        self.prefill = [i for i, r in enumerate(roles) if r == "prefill"]
        self.decode = [i for i, r in enumerate(roles) if r == "decode"]
        self.router, self.transport, self.prepare = router, transport, prepare
        self._views = views if views is not None else [EngineReplica(replicas[i])
                                                        for i in self.decode]
        self._parked: collections.deque[tuple[int, str, float]] = collections.deque()
        self._flights: list[Flight] = []
        n = len(replicas)
        self.reserved = [0] * n  # hand-overs in flight to each replica, not started there yet
        self.sent_bytes, self.received_bytes, self.wire_bytes = [0] * n, [0] * n, [0] * n
        self.num_handovers = [0] * n
        self.records: list[HandOverRecord] = []

    # --- the queue ------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a request is parked or a source still holds blocks of a transfer."""
        return bool(self._parked or self._flights)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def parked_request_ids(self) -> list[str]:
        """Requests parked on a prefill replica, waiting for a decode replica (FIFO order)."""
        return [r for _, r, _ in self._parked]

    def held_seq_ids(self, replica: int) -> list:
        """Sequence ids whose blocks replica ``replica`` still holds for a dispatched transfer."""
        return [i for f in self._flights if f.record.source == replica for i in f.old_ids]

    def in_flight(self, request_id: str) -> Flight | None:
        """The flight of ``request_id`` if it was dispatched and has not landed."""
        return next((f for f in self._flights if f.record.request_id == request_id), None)

    def park(self, i: int, now: float) -> int:
        """Parks prefill replica ``i``'s requests whose first token is known; how many."""
        ids = self.replicas[i].core.park_prefilled()
        self._parked.extend((i, r, now) for r in ids)
        return len(ids)

    def run(self, now: float | None = None) -> list[tuple[str, int]]:
        """The engine's step end: park on every prefill replica, release landed transfers, place
        and move (module docstring). Returns ``(request_id, decode replica)`` per request
        moved now."""
        now = time.perf_counter() if now is None else now
        for i in self.prefill:
            self.park(i, now)
        for flight, end in self.transport.landed():
            self.land(flight, end)
        moved = self.place_parked(now)
        for i in {i for i, _, _ in self._parked}:  # waiting on the decode side is progress
            self.replicas[i].core.note_progress()
        return moved

    def place_parked(self, now: float) -> list[tuple[str, int]]:
        """Places and dispatches parked requests in FIFO order while the head fits somewhere."""
        moved = []
        while self._parked:
            i, request_id, ready = self._parked[0]
            seqs = self.replicas[i].core.transfer_seqs(request_id)
            if not seqs:  # aborted or timed out while parked: its blocks were freed then
                self._parked.popleft()
                continue
            j = self.place(seqs)
            if j is None:
                break  # FIFO: everything behind the head waits too
            self._parked.popleft()
            self._move(i, j, request_id, seqs, ready, now)
            moved.append((request_id, j))
        return moved

    # --- place, reserve, transfer, start, abandon ---------------------------------------------
    def _fits(self, j: int, seqs, tokens, salt) -> bool:
        rep = self.replicas[j]
        sched = rep.core.scheduler
        if sched.waiting or sched.swapped or len(sched.running) + self.reserved[j] + len(seqs) \
                > rep.config.max_num_seqs:
            return False
        if self.prepare is not None:
            self.prepare(j)
        return rep.block_manager.can_allocate(tokens, cache_salt=salt)

    def place(self, seqs) -> int | None:
        """The one placement rule (module docstring): the decode replica for a parked request's
        ``seqs``, or None if none can take it now."""
        head = seqs[0]
        tokens = head.token_ids[:head.num_computed_tokens]
        ok = [k for k, j in enumerate(self.decode)
              if self._fits(j, seqs, tokens, head.cache_salt)]
        if not ok:
            return None
        views = [self._views[k] for k in ok]
        # TODO(F: HostCore.load()): one load definition for every router and placement.
        loads = [v.num_waiting + v.num_running + self.reserved[self.decode[k]]
                 for v, k in zip(views, ok)]
        k = self.router.route(tokens, views, head.cache_salt, loads=loads)
        return self.decode[ok[k]]

    def _move(self, i: int, j: int, request_id: str, seqs, ready: float, now: float) -> None:
        src, dst = self.replicas[i], self.replicas[j]
        head = seqs[0]
        n = head.num_computed_tokens
        if any(s.num_computed_tokens != n for s in seqs):
            raise AssertionError(f"{request_id}: samples differ in computed tokens")
        got = dst.core.reserve_received(head.token_ids[:n], head.cache_salt, len(seqs))
        if got is None:
            raise AssertionError(f"{request_id}: can_allocate held but allocate failed")
        hit, new_ids = got
        size = src.page_size
        src_pages = src.block_manager.block_table(head.seq_id)[:-(-n // size)]
        first = hit // size
        src_pages, dst_pages = src_pages[first:], dst.block_manager.block_table(new_ids[0])[first:]
        old_ids = [s.seq_id for s in seqs]
        for s, new in zip(seqs, new_ids):  # the moving (``TRANSFER``) sequences
            s.seq_id = new
        nbytes = self.transport.nbytes(n - hit, size)
        record = HandOverRecord(request_id, i, j, n, hit, len(src_pages), nbytes, 0, ready, now)
        flight = Flight(record, src.core.release_request(request_id), old_ids)
        self.records.append(record)
        self._flights.append(flight)
        self.reserved[j] += 1
        record.wire_bytes = self.transport.send(flight, src, dst, src_pages, dst_pages, now)
        for r in (i, j):
            self.num_handovers[r] += 1
            self.wire_bytes[r] += record.wire_bytes
        self.sent_bytes[i] += nbytes
        self.received_bytes[j] += nbytes
        if self.transport.starts_on_dispatch:
            self._start(flight)

    def _start(self, flight: Flight) -> None:
        j = flight.record.dest
        self.reserved[j] -= 1
        flight.started = True
        self.replicas[j].core.start_received(flight.record.request_id, flight.seqs)

    def land(self, flight: Flight, now: float) -> bool:
        """``flight``'s pages are on the destination at ``now``: the source's held blocks are
        freed, and the request starts there unless it started at dispatch or was abandoned.
        Returns whether it started now."""
        rec = flight.record
        rec.end_s = now
        self._flights.remove(flight)
        bm = self.replicas[rec.source].block_manager
        for seq_id in flight.old_ids:
            bm.free(seq_id)
        if flight.started:
            return False
        if rec.aborted:
            self.reserved[rec.dest] -= 1
            self.replicas[rec.dest].core.release_received(
                [s.seq_id for s in flight.seqs if not s.finished])
            return False
        if self.prepare is not None:
            self.prepare(rec.dest)
        self._start(flight)
        return True

    def abandon(self, request_id: str) -> Flight | None:
        """A client's abort of a request in flight (not started anywhere): both sides' blocks
        are freed when the copy ends (the copy is ordered before any reuse). Returns its flight,
        or None if it is not in flight."""
        flight = self.in_flight(request_id)
        if flight is None or flight.started:
            return None
        flight.record.aborted = True
        return flight

    # --- engine-side extras ---------------------------------------------------------------------
    def warmup(self) -> int:
        """The transport's warm-up (the device copy compiles its page buckets); returns what it
        returns."""
        return self.transport.warmup(self.replicas, self.prefill, self.decode)

    def replica_stats(self, i: int) -> dict:
        """Replica ``i``'s hand-over figures: ``kv_transfer_bytes`` (sent by a prefill replica,
        received by a decode replica), ``kv_transfer_wire_bytes``, ``num_handovers`` and
        ``num_parked`` (requests parked on it)."""
        return {"kv_transfer_bytes": self.sent_bytes[i] + self.received_bytes[i],
                "kv_transfer_wire_bytes": self.wire_bytes[i],
                "num_handovers": self.num_handovers[i],
                "num_parked": sum(1 for s, _, _ in self._parked if s == i)}


__all__ = ["Flight", "HandOver", "HandOverRecord"]
