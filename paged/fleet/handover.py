"""Prefill/decode disaggregation: handing a prefilled request's KV pages to a decode replica.

With ``EngineConfig(data_parallel_size=D, prefill_replicas=P)`` replicas ``0 .. P-1`` only
prefill and ``P .. D-1`` only decode (``paged.engine.data_parallel``). A request computes its prompt and
samples its first token on a prefill replica; at the end of that step ``HandOver.run``:

1. **parks** it (``HostCore.park_prefilled``): its sequences leave the prefill scheduler (status
   ``TRANSFER``: no row, never scheduled, preempted or decoded there) and keep their blocks;
2. **places** parked requests in arrival order (FIFO, no overtaking) on a decode replica that can
   take them now: nothing waiting or swapped out there, room for the request's sequences under
   ``max_num_seqs``, and ``BlockManager.can_allocate`` of its prompt. Among those the decode-side
   ``Router`` chooses (load, and prefix hits in the decode replicas' caches). When none can take
   the head of the queue, it and everything behind it wait on the prefill side, holding their
   blocks;
3. **moves** it: the decode replica allocates the prompt (``BlockManager.allocate``: its own
   prefix-cache hits are reused, only the other blocks travel), the prefill replica gathers those
   pages into new arrays (``Engine.send_pages``: a jitted gather, not donated),
   ``jax.device_put`` places them on the decode replica's KV sharding (the same
   ``PartitionSpec``, so with tensor parallel each KV-head shard goes to the matching shard),
   and the decode replica scatters them into its fresh blocks (``Engine.receive_pages``: jitted,
   its cache donated). All three are dispatched without waiting; the decode replica's next step
   takes the scattered cache as input, so it reads the pages only after they landed. The
   request then belongs to the decode replica's table (sequence ids re-issued there; parallel
   samples fork from the received prompt blocks);
4. **releases** the prefill replica's blocks once the moved arrays are ready (a helper thread
   waits for them and stamps the time; the engine checks at each step end and never waits): until then they stay referenced under their old sequence ids, so
   the pool cannot hand them out; when freed, the step fence quarantines them as usual.

Why a gather + ``device_put`` + scatter: the pool's pages of one request are scattered over the
source cache, and the destination's free blocks over its own; a gather packs them into one array
per leaf (values and, for quantized pages, their scales: one tree-map moves both), so a hand-over
is one batched transfer of whole pages, and ``device_put`` is the one way to move an array
between devices of one process (no home-made RPC). Pages are padded to a power of two (the null
page fills the rest) so the jitted gather and scatter compile a handful of shapes.

Why no deadlock: a decode replica receives nothing but hand-overs, and takes one only with
nothing waiting and blocks to spare, so what runs there finishes and frees room; the queue is
FIFO, so the oldest parked request gets the first room that fits it. The limit: head-of-line
blocking (a large request at the head holds back smaller ones that would fit), and parked
requests keep their blocks on the prefill side, so a prefill pool full of parked requests admits
nothing new until the decode side drains.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time

import jax

from paged import accounting
from paged.fleet.routing import EngineReplica, Router


@dataclasses.dataclass
class HandOverRecord:
    """One hand-over.

    Attributes:
      request_id: the request moved.
      source, dest: replica indices (prefill, decode).
      num_tokens: prompt tokens whose KV the prefill replica computed.
      hit_tokens: of those, held by the decode replica's prefix cache (not sent).
      num_pages: pages sent (``ceil((num_tokens - hit_tokens) / block_size)``).
      bytes: KV bytes of the tokens sent, ``M_KV = 2 L n h_kv d_h b`` with ``n = num_tokens -
        hit_tokens`` (plus the scales of a quantized cache): ``accounting.kv_bytes``.
      wire_bytes: bytes of the arrays moved: whole pages, padded to a power of two.
      dispatched: ``time.perf_counter()`` when the transfer was dispatched.
      seconds: from dispatch until the moved arrays were ready on the destination (a helper
        thread waits for them; it includes the wait for the source's step in flight, which the
        gather follows); ``None`` until the step end that sees it.
    """

    request_id: str
    source: int
    dest: int
    num_tokens: int
    hit_tokens: int
    num_pages: int
    bytes: int
    wire_bytes: int
    dispatched: float
    seconds: float | None = None


@dataclasses.dataclass
class _Flight:
    record: HandOverRecord
    old_ids: list  # the sequences' ids on the source, whose blocks are still held there
    landed: concurrent.futures.Future  # perf_counter() when the moved (k, v) were ready


def _wait(arrays) -> float:
    jax.block_until_ready(arrays)
    return time.perf_counter()


class HandOver:
    """Parks prefilled requests, places them on decode replicas and moves their pages.

    Args:
      replicas: every replica engine (``paged.engine.engine.Engine``), in index order.
      roles: ``"prefill"`` or ``"decode"`` per replica.
      router: the decode-side ``paged.fleet.routing.Router``.
      spec: the model's ``accounting.ModelSpec`` (bytes per token, scales).

    Attributes:
      records: one ``HandOverRecord`` per hand-over, in order.
      sent_bytes, received_bytes, wire_bytes: per replica, ``bytes`` (``wire_bytes``) sent by a
        prefill replica or received by a decode replica.
      num_handovers: per replica, hand-overs sent or received.
    """

    def __init__(self, replicas: list, roles: list[str], router: Router, spec):
        self.replicas = replicas
        self.prefill = [i for i, r in enumerate(roles) if r == "prefill"]
        self.decode = [i for i, r in enumerate(roles) if r == "decode"]
        self.router = router
        self.spec = spec
        self._views = [EngineReplica(replicas[i]) for i in self.decode]
        self._parked: collections.deque[tuple[int, str]] = collections.deque()
        self._flights: list[_Flight] = []
        n = len(replicas)
        self.sent_bytes, self.received_bytes, self.wire_bytes = [0] * n, [0] * n, [0] * n
        self.num_handovers = [0] * n
        self.records: list[HandOverRecord] = []
        # Waits for moved arrays off the engine's thread, so a transfer's time is measured when
        # it lands, not when the next step end looks (the engine itself never waits on it).
        self._waiter = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="handover")

    @property
    def busy(self) -> bool:
        """Whether a request is parked or a source still holds blocks of a transfer."""
        return bool(self._parked or self._flights)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def parked_request_ids(self) -> list[str]:
        """Requests parked on a prefill replica, waiting for a decode replica (FIFO order)."""
        return [r for _, r in self._parked]

    def held_seq_ids(self, replica: int) -> list:
        """Sequence ids whose blocks replica ``replica`` still holds for a dispatched transfer."""
        return [i for f in self._flights if f.record.source == replica for i in f.old_ids]

    def run(self, now: float | None = None) -> list[tuple[str, int]]:
        """A step's end: park, release finished transfers, place and move (module docstring).

        Returns:
          ``(request_id, decode replica)`` of each request moved now.
        """
        now = time.perf_counter() if now is None else now
        for i in self.prefill:
            self._parked.extend((i, r) for r in self.replicas[i].core.park_prefilled())
        self._release()
        moved = []
        while self._parked:
            i, request_id = self._parked[0]
            seqs = self.replicas[i].core.transfer_seqs(request_id)
            if not seqs:  # aborted or timed out while parked: its blocks were freed then
                self._parked.popleft()
                continue
            j = self._place(seqs)
            if j is None:
                break  # FIFO: everything behind the head waits too
            self._parked.popleft()
            self._move(i, j, request_id, seqs, now)
            moved.append((request_id, j))
        for i in {i for i, _ in self._parked}:  # waiting on the decode side is progress
            self.replicas[i].core.note_progress()
        return moved

    def _release(self) -> None:
        keep = []
        for f in self._flights:
            if f.landed.done():
                f.record.seconds = f.landed.result() - f.record.dispatched
                bm = self.replicas[f.record.source].block_manager
                for seq_id in f.old_ids:
                    bm.free(seq_id)
            else:
                keep.append(f)
        self._flights = keep

    def _fits(self, engine, seqs, tokens, salt) -> bool:
        sched = engine.scheduler
        return (not sched.waiting and not sched.swapped
                and len(sched.running) + len(seqs) <= engine.config.max_num_seqs
                and engine.block_manager.can_allocate(tokens, cache_salt=salt))

    def _place(self, seqs) -> int | None:
        head = seqs[0]
        tokens = head.token_ids[:head.num_computed_tokens]
        ok = [k for k, j in enumerate(self.decode)
              if self._fits(self.replicas[j], seqs, tokens, head.cache_salt)]
        if not ok:
            return None
        k = self.router.route(tokens, [self._views[k] for k in ok], head.cache_salt)
        return self.decode[ok[k]]

    def _move(self, i: int, j: int, request_id: str, seqs, now: float) -> None:
        src, dst = self.replicas[i], self.replicas[j]
        head = seqs[0]
        n = head.num_computed_tokens
        if any(s.num_computed_tokens != n for s in seqs):
            raise AssertionError(f"{request_id}: samples differ in computed tokens")
        tokens = head.token_ids[:n]
        size = src.page_size
        src_pages = src.block_manager.block_table(head.seq_id)[:-(-n // size)]
        old_ids = [s.seq_id for s in seqs]
        for s in seqs:
            s.seq_id = dst.core.new_seq_id()
        bm = dst.block_manager
        hit = bm.allocate(head.seq_id, tokens, cache_salt=head.cache_salt)
        if hit is None:
            raise AssertionError(f"{request_id}: can_allocate held but allocate failed")
        first = hit // size
        src_pages, dst_pages = src_pages[first:], bm.block_table(head.seq_id)[first:]
        k, v = jax.device_put(src.send_pages(src_pages), dst.placement.kv)
        dst.receive_pages(dst_pages, k, v)
        bm.mark_computed(head.seq_id, n)
        for s in seqs[1:]:  # parallel samples share the received prompt blocks
            bm.fork(head.seq_id, s.seq_id)
        dst.core.adopt_request(request_id, src.core.release_request(request_id))
        record = HandOverRecord(
            request_id, i, j, n, hit, len(src_pages),
            accounting.kv_bytes(self.spec, n - hit, page_size=size),
            sum(int(x.nbytes) for x in jax.tree.leaves((k, v))), now)
        self.records.append(record)
        self._flights.append(_Flight(record, old_ids, self._waiter.submit(_wait, (k, v))))
        for r in (i, j):
            self.num_handovers[r] += 1
            self.wire_bytes[r] += record.wire_bytes
        self.sent_bytes[i] += record.bytes
        self.received_bytes[j] += record.bytes

    def warmup(self) -> int:
        """Compiles every page-count bucket of the gather on each prefill replica and of the
        scatter on each decode replica (null pages only: nothing live is read or written), so no
        hand-over pays for a compilation. Returns the number of buckets."""
        e = self.replicas[self.prefill[0]]
        counts = []
        c = 1
        while c < 2 * e.pages_per_seq:  # up to next_pow2(pages_per_seq)
            counts.append(c)
            c *= 2
        for i in self.prefill:
            for j in self.decode:
                for c in counts:
                    dst = self.replicas[j]
                    k, v = jax.device_put(self.replicas[i].send_pages([0] * c), dst.placement.kv)
                    dst.receive_pages([0] * c, k, v)
        jax.block_until_ready([self.replicas[j].cache for j in self.decode])
        return len(counts)

    def replica_stats(self, i: int) -> dict:
        """Replica ``i``'s hand-over figures: ``kv_transfer_bytes`` (sent by a prefill replica,
        received by a decode replica), ``kv_transfer_wire_bytes``, ``num_handovers`` and
        ``num_parked`` (requests parked on it)."""
        return {"kv_transfer_bytes": self.sent_bytes[i] + self.received_bytes[i],
                "kv_transfer_wire_bytes": self.wire_bytes[i],
                "num_handovers": self.num_handovers[i],
                "num_parked": sum(1 for s, _ in self._parked if s == i)}


__all__ = ["HandOver", "HandOverRecord"]
