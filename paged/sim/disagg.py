"""A disaggregated fleet as a policy of the simulator's event loop (``paged.sim.event_loop``):
P prefill replicas hand each prompt's KV to D - P decode replicas over a link
(``Simulator(..., prefill_replicas=P, handover=...)``).

A request's life, in simulated time:

1. **Prefill.** It is routed among the prefill replicas (the simulator's router: prefix-aware,
   least loaded or round robin) and runs there as a request of one output token: the replica
   computes its prompt in chunks and samples its first token (TTFT is that token's time, as a
   client streaming from the prefill side sees it). A request of one output token ends here.
2. **Waiting for a decode replica.** When the first token is read back, the request leaves the
   prefill replica's schedule but its prompt's blocks stay held there (``SimReplica.hold_prompt``)
   and it joins one FIFO queue of hand-overs. The head of the queue goes to the least loaded
   decode replica (running + waiting + swapped + hand-overs in flight to it; ties by index from a
   rotating start) that has a sequence slot (``max_num_seqs``) and room for the prompt's blocks
   (``HostCore.reserve_received``: all or nothing); if none has, the head and everything behind
   it wait (no overtaking, so nothing starves), holding their prefill-side blocks, and the queue
   is tried again at every later event. The rule cannot deadlock: a decode replica's blocks are
   freed by its own decodes, which never wait for the prefill side; its limit is head-of-line
   blocking (a long prompt at the head holds back short ones that would fit).
3. **Transfer.** Blocks are reserved on the decode side first, then the prompt's KV
   (``Handover.nbytes``: ``M_KV`` of the prompt) crosses the link: it starts when the sending
   and the receiving GPU are both free of earlier transfers (one at a time each way per GPU) and
   takes ``Handover.time`` (latency + bytes / bandwidth). The prefill replica's steps go on
   meanwhile (the copy overlaps them).
4. **Decode.** At the transfer's end the held prefill-side blocks are freed (full ones stay in
   that replica's prefix cache) and the request joins the decode replica running, its prompt
   computed and its first token known (``HostCore.start_received``): its next step there decodes.
   A decode replica preempted by a full pool recomputes (or swaps) as any replica does; a
   recomputed prompt is counted in its ``num_prefill_tokens``.

Aborts: on the prefill side or the decode side as in a colocated fleet; while waiting, at once
(the held blocks are freed); mid-transfer, the request is reported aborted at once and both sides'
blocks are freed when the transfer ends (the copy is ordered before any reuse). A request's timeout
is checked by the replica that holds it and, while it waits, when it reaches the queue's head. The
time limit aborts everything unfinished, hand-overs included.

Each hand-over is recorded (``SimResult.handovers``): request, replicas, bytes, when the first
token was ready, when the transfer began and ended. Decode replicas fast-forward stretches of pure
decode steps as colocated ones do; a hand-over that reserves blocks on or joins a replica
mid-stretch applies the stretch up to that moment first. Prefill replicas never fast-forward.
Parallel samples (``n > 1``) are not modelled here (a ValueError before the run).
"""

from __future__ import annotations

import collections
import math

from paged.request.checks import derive_seed
from paged.request.sampling import SamplingParams
from paged.request.sequence import UNKNOWN, Sequence
from paged.workload import metrics


class _Handover:
    __slots__ = ("aborted", "deadline", "dst", "end_s", "first", "nbytes", "out", "prompt",
                 "ready_s", "rid", "seq", "spec", "src", "start_s")

    def __init__(self, rid, spec, src, out, prompt, nbytes, ready_s, deadline):
        self.rid, self.spec, self.src, self.out, self.prompt = rid, spec, src, out, prompt
        self.first = out.token_ids[0]
        self.nbytes, self.ready_s, self.deadline = nbytes, ready_s, deadline
        self.dst = self.seq = self.start_s = self.end_s = None
        self.aborted = False

    def as_dict(self) -> dict:
        return {"request_id": self.rid, "prefill_replica": self.src, "decode_replica": self.dst,
                "prompt_len": len(self.prompt), "bytes": self.nbytes, "ready_s": self.ready_s,
                "start_s": self.start_s, "end_s": self.end_s,
                "wait_s": None if self.start_s is None else self.start_s - self.ready_s,
                "transfer_s": None if self.end_s is None else self.end_s - self.start_s,
                "aborted": self.aborted}


class Disaggregated:
    """The fleet policy of P prefill replicas (``replicas[:P]``) and decode replicas
    (``replicas[P:]``), for ``paged.sim.event_loop.EventLoop`` (module docstring).

    Args:
      num_prefill: P, the prefill replicas (arrivals are routed among them).
      decode: the decode replicas (``SimReplica`` with role "decode").
      handover: prices each hand-over (``paged.sim.handover.Handover``).
      seed: the engine seed (unseeded requests' sampling seeds derive from it and the request's
        index in the workload, so both sides agree).
    """

    def __init__(self, num_prefill: int, decode, handover, seed: int):
        self.num_routable = self.P = num_prefill
        self.decode = list(decode)
        self.handover, self.seed = handover, seed
        self.hands: list[_Handover] = []
        self.moving: dict[str, _Handover] = {}  # handed, not yet started on a decode replica
        self.pending: collections.deque[_Handover] = collections.deque()
        D = len(self.decode)
        self.reserved = [0] * D  # hand-overs in flight to each decode replica
        self.src_free = [0.0] * num_prefill  # each GPU's link is busy until then
        self.dst_free = [0.0] * D
        self.rot = 0
        self.loop = None

    def check(self, specs) -> None:
        bad = [s.request_id for s in specs if s.n != 1]
        if bad:
            raise ValueError(f"requests {bad[:5]} ask for n > 1 samples; a disaggregated "
                             "simulation models n = 1 only")

    def bind(self, loop) -> None:
        self.loop = loop

    def params(self, spec, index: int) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              seed=derive_seed(self.seed, index))

    # --- the prefill side -----------------------------------------------------------------------
    def finished(self, r: int, out, now: float) -> bool:
        """A prefill replica's request that sampled its first token joins the hand-over queue."""
        spec = self.loop.spec_of[out.request_id]
        if not (r < self.P and out.finish_reason == "length" and spec.output_len > 1):
            return False
        rid, prompt = out.request_id, out.prompt_token_ids
        rep = self.loop.replicas[r]
        rep.hold_prompt(rid, prompt)
        timeout_s = self.loop.timeout_s
        deadline = None if timeout_s is None else out.arrival_time + timeout_s
        h = _Handover(rid, spec, r, out, prompt,
                      self.handover.nbytes(len(prompt), rep.page_size), now, deadline)
        self.hands.append(h)
        self.pending.append(h)
        self.moving[rid] = h
        return True

    def abort(self, rid: str, now: float) -> bool:
        if rid in self.loop.records:
            return True
        h = self.moving.get(rid)
        if h is None:
            return False
        if h.start_s is None:  # still waiting: freed at once
            self.pending.remove(h)
            self.loop.replicas[h.src].release_prompt(rid, 0)
        else:  # mid-transfer: freed when the copy ends
            h.aborted = True
        self._dropped(h, "aborted", now)
        return True

    def _dropped(self, h: _Handover, status: str, now: float) -> None:
        out = h.out
        now = max(now, h.ready_s)
        self.loop.records[h.rid] = metrics.RequestRecord(
            request_id=h.rid, status=status, arrival_s=out.arrival_time,
            first_scheduled_s=out.first_scheduled_time, first_token_s=out.first_token_time,
            finish_s=now, token_times=tuple(out.token_times), prompt_len=h.spec.prompt_len,
            output_len=len(out.token_ids), num_preemptions=out.num_preemptions,
            num_cached_tokens=out.num_cached_tokens)

    # --- placement and transfer -----------------------------------------------------------------
    def _load(self, d: int) -> int:
        rep = self.decode[d]
        return rep.num_running + rep.num_waiting + self.reserved[d]

    def _place(self, h: _Handover, now: float, ready: list) -> int | None:
        """Reserves blocks for ``h`` on a decode replica; its index, or None."""
        D, P, loop = len(self.decode), self.P, self.loop
        for d in sorted(range(D), key=lambda d: (self._load(d), (d - self.rot) % D)):
            rep = self.decode[d]
            if self._load(d) >= rep.config.max_num_seqs:
                continue
            if P + d in loop.stretching:
                loop.cut(P + d, now, ready)
            out = h.out
            seed = derive_seed(self.seed, loop.index_of[h.rid])
            seq = Sequence(rep.new_seq_id(), h.rid, list(h.prompt) + [UNKNOWN], len(h.prompt),
                           SamplingParams(max_tokens=h.spec.output_len, temperature=0.0,
                                          ignore_eos=True, seed=seed),
                           seed, out.arrival_time, deadline=h.deadline)
            seq.set_sampled(len(h.prompt), h.first, out.first_token_time)
            seq.num_computed_tokens = len(h.prompt)
            if not rep.reserve_received(seq):
                continue
            seq.first_scheduled_time = out.first_scheduled_time
            seq.first_token_time = out.first_token_time
            seq.num_cached_tokens = out.num_cached_tokens
            seq.num_preemptions = out.num_preemptions
            h.seq, h.dst = seq, d
            self.reserved[d] += 1
            self.rot = (d + 1) % D
            return d
        return None

    def _try_handovers(self, now: float, ready: list) -> None:
        """The queue's head, then the next, ... go to decode replicas while one has room."""
        pending, reps = self.pending, self.loop.replicas
        while pending:
            h = pending[0]
            if h.deadline is not None and now >= h.deadline:
                pending.popleft()
                reps[h.src].release_prompt(h.rid, 0)
                self._dropped(h, "timeout", now)
                continue
            d = self._place(h, now, ready)
            if d is None:
                return
            pending.popleft()
            h.start_s = max(now, self.src_free[h.src], self.dst_free[d])
            h.end_s = h.start_s + self.handover.time(h.nbytes)
            self.src_free[h.src] = self.dst_free[d] = h.end_s
            self.loop.push_policy(h.end_s, h)

    def on_event(self, h: _Handover, now: float, ready: list) -> None:
        """``h``'s transfer ended: the request joins its decode replica (or both sides' blocks
        are freed if it was aborted meanwhile)."""
        loop = self.loop
        d = h.dst
        r = self.P + d
        self.reserved[d] -= 1
        if h.aborted:
            self.decode[d].cancel_received(h.seq)
            loop.replicas[h.src].release_prompt(h.rid, 0)
            return
        if r in loop.stretching:
            loop.cut(r, now, ready)
        loop.replicas[h.src].release_prompt(h.rid, h.nbytes)
        self.decode[d].start_received(h.seq, h.nbytes)
        del self.moving[h.rid]
        loop.where[h.rid] = r
        loop.routed[r] += 1
        loop.wake_up(r, now, ready)

    def before_begin(self, now: float, ready: list) -> None:
        if self.pending:
            self._try_handovers(now, ready)

    def after_begin(self, now: float) -> None:
        if self.pending:  # an abort or timeout a step began with may have made room
            more: list = []
            self._try_handovers(now, more)
            self.loop.begin_ready(more, now)

    # --- the end of the run ---------------------------------------------------------------------
    def close(self, end: float) -> None:
        for h in self.hands:  # unfinished hand-overs at the time limit
            if h.rid not in self.loop.records and (h.end_s is None or h.end_s > end):
                h.aborted = True
                self._dropped(h, "aborted", end)

    def summarize(self, summary: dict) -> None:
        done = [h for h in self.hands if h.end_s is not None and not h.aborted]
        secs = sorted(h.end_s - h.start_s for h in done)
        waits = sorted(h.start_s - h.ready_s for h in done)
        summary.update(
            num_prefill_replicas=self.P, num_handovers=len(done),
            kv_transfer_bytes=sum(h.nbytes for h in done),
            mean_transfer_ms=_ms(secs, None), p99_transfer_ms=_ms(secs, 0.99),
            mean_handover_wait_ms=_ms(waits, None), p99_handover_wait_ms=_ms(waits, 0.99))

    def records(self) -> list:
        return [h.as_dict() for h in self.hands]


def _ms(xs: list, q: float | None):
    """The mean (``q=None``) or the ``q`` quantile (nearest rank) of sorted seconds ``xs``, in
    ms; None if empty."""
    if not xs:
        return None
    if q is None:
        return 1e3 * sum(xs) / len(xs)
    return 1e3 * xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


__all__ = ["Disaggregated"]
