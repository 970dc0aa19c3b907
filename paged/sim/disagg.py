"""A disaggregated fleet as a policy of the simulator's event loop (``paged.sim.event_loop``):
P prefill replicas hand each prompt's KV to D - P decode replicas over a link
(``Simulator(..., prefill_replicas=P, handover=LinkTransport(link, model))``).

The hand-over is the engine's protocol (``paged.fleet.handover.HandOver``: park, place by its one
rule, reserve all or nothing, transfer, start, or abandon) on the simulated replicas' host cores,
with a priced link as its transport (``paged.sim.link_transport``). A request's life, in
simulated time:

1. **Prefill.** It is routed among the prefill replicas (the simulator's router) and runs there:
   the replica computes its prompt in chunks and samples its first token (TTFT is that token's
   time, as a client streaming from the prefill side sees it). A request of one output token
   ends here.
2. **Park and place.** At the end of that step the request is parked on the prefill replica,
   holding its blocks, and joins the FIFO queue; the queue's head goes to a decode replica that
   fits it (nothing waiting or swapped there, a sequence slot with the hand-overs in flight to it
   counted, room for the prompt's blocks) chosen by the decode side's router
   (``EngineConfig.router`` of the decode replicas); if none fits, everything waits, and the
   queue is tried again at every later event.
3. **Transfer.** The decode replica reserves the prompt's blocks (its prefix-cache hits are not
   sent); the KV of the other tokens crosses the link, starting when the sending and the
   receiving GPU are both free of earlier transfers (one at a time each way per GPU), taking
   ``LinkTransport.time`` (latency + bytes / bandwidth). The prefill replica's steps go on.
4. **Decode.** At the transfer's end the prefill replica's held blocks are freed (full ones stay
   in its prefix cache) and the request runs on the decode replica, its prompt computed and its
   first token known: its next step there decodes.

Aborts: on the prefill side (parked included) or the decode side as in a colocated fleet;
mid-transfer, the request is reported aborted at once and both sides' blocks are freed when the
transfer ends. The time limit aborts everything unfinished, transfers included.

Each hand-over is recorded (``SimResult.handovers``: ``HandOverRecord.as_dict``). Decode replicas
fast-forward stretches of pure decode steps as colocated ones do; the protocol applies a
stretch up to now before it reads or changes that replica (``HandOver(prepare=...)``). Prefill
replicas never fast-forward. Parallel samples (``n > 1``) are not modelled here (a ValueError
before the run).
"""

from __future__ import annotations

import math

from paged.fleet.handover import HandOver
from paged.fleet.routing import Router
from paged.request.checks import derive_seed
from paged.request.sampling import SamplingParams
from paged.workload import metrics


class _Link:
    """One run's link for ``HandOver``: one transfer at a time per sending and per receiving
    GPU; each landing is an event of the loop."""

    starts_on_dispatch = False

    def __init__(self, price, push):
        self.price, self.push = price, push
        self.src_free: dict[int, float] = {}
        self.dst_free: dict[int, float] = {}

    def nbytes(self, num_tokens: int, page_size: int) -> int:
        return self.price.nbytes(num_tokens, page_size)

    def send(self, flight, src, dst, src_pages, dst_pages, now: float) -> int:
        rec = flight.record
        rec.start_s = max(now, self.src_free.get(rec.source, 0.0),
                          self.dst_free.get(rec.dest, 0.0))
        end = rec.start_s + self.price.time(rec.bytes)
        self.src_free[rec.source] = self.dst_free[rec.dest] = end
        self.push(end, (flight, end))
        return rec.bytes

    def landed(self) -> list:
        return []  # landings are the loop's events


class Disaggregated:
    """The fleet policy of P prefill replicas (``replicas[:P]``) and decode replicas
    (``replicas[P:]``), for ``paged.sim.event_loop.EventLoop`` (module docstring).

    Args:
      num_prefill: P, the prefill replicas (arrivals are routed among them).
      transport: prices each hand-over (``paged.sim.link_transport.LinkTransport``).
      seed: the engine seed (unseeded requests' sampling seeds derive from it and the request's
        index in the workload).
    """

    def __init__(self, num_prefill: int, transport, seed: int):
        self.num_routable = self.P = num_prefill
        self.transport, self.seed = transport, seed
        self.loop = self.protocol = None
        self._now, self._ready = 0.0, []

    def check(self, specs) -> None:
        bad = [s.request_id for s in specs if s.n != 1]
        if bad:
            raise ValueError(f"requests {bad[:5]} ask for n > 1 samples; a disaggregated "
                             "simulation models n = 1 only")

    def bind(self, loop) -> None:
        self.loop = loop
        reps, P = loop.replicas, self.P
        cfg = reps[P].config
        self.protocol = HandOver(
            reps, ["prefill"] * P + ["decode"] * (len(reps) - P),
            Router(cfg.router, cfg.router_load_threshold),
            transport=_Link(self.transport, loop.push_policy), views=reps[P:],
            prepare=self._prepare)

    def params(self, spec, index: int) -> SamplingParams:
        return SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True,
                              seed=derive_seed(self.seed, index))

    def _prepare(self, j: int) -> None:
        """The protocol reads or changes decode replica ``j``: apply its stretch up to now."""
        if j in self.loop.stretching:
            self.loop.cut(j, self._now, self._ready)

    def _place(self, now: float, ready: list) -> None:
        self._now, self._ready = now, ready
        self.protocol.place_parked(now)

    # --- the loop's hooks -----------------------------------------------------------------------
    def after_step(self, r: int, now: float) -> None:
        if r < self.P:
            self.protocol.park(r, now)

    def abort(self, rid: str, now: float) -> bool:
        if rid in self.loop.records:
            return True
        flight = self.protocol.abandon(rid)
        if flight is None:
            return False
        self._record(flight, "aborted", now)
        return True

    def on_event(self, payload, now: float, ready: list) -> None:
        """A transfer ended: the request starts on its decode replica (both sides' blocks are
        freed instead if it was abandoned meanwhile)."""
        flight, _ = payload
        self._now, self._ready = now, ready
        rec = flight.record
        if not self.protocol.land(flight, now):
            return
        reps, loop = self.loop.replicas, self.loop
        reps[rec.source].note_transfer(rec.bytes)
        reps[rec.dest].note_transfer(rec.bytes)
        loop.where[rec.request_id] = rec.dest
        loop.routed[rec.dest] += 1
        loop.wake_up(rec.dest, now, ready)

    def before_begin(self, now: float, ready: list) -> None:
        if self.protocol.num_parked:
            self._place(now, ready)

    def after_begin(self, now: float) -> None:
        if self.protocol.num_parked:  # an abort or timeout a step began with may have made room
            more: list = []
            self._place(now, more)
            self.loop.begin_ready(more, now)

    # --- records --------------------------------------------------------------------------------
    def _record(self, flight, status: str, now: float) -> None:
        seq, rec = flight.seqs[0], flight.record
        self.loop.records[rec.request_id] = metrics.RequestRecord(
            request_id=rec.request_id, status=status, arrival_s=seq.arrival_time,
            first_scheduled_s=seq.first_scheduled_time, first_token_s=seq.first_token_time,
            finish_s=max(now, rec.ready_s),
            token_times=tuple(seq.token_times[:seq.num_output_tokens]),
            prompt_len=self.loop.spec_of[rec.request_id].prompt_len,
            output_len=seq.num_output_tokens, num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens)

    def close(self, end: float) -> None:
        # Parked requests are in their prefill replica's table: the end aborts them there.
        for rec in self.protocol.records:  # transfers unfinished at the time limit
            if rec.end_s is None and rec.request_id not in self.loop.records:
                rec.aborted = True
                self._record(self.protocol.in_flight(rec.request_id), "aborted", end)

    def summarize(self, summary: dict) -> None:
        done = [r for r in self.protocol.records if r.end_s is not None and not r.aborted]
        secs = sorted(r.seconds for r in done)
        waits = sorted(r.wait_s for r in done)
        summary.update(
            num_prefill_replicas=self.P, num_handovers=len(done),
            kv_transfer_bytes=sum(r.bytes for r in done),
            mean_transfer_ms=_ms(secs, None), p99_transfer_ms=_ms(secs, 0.99),
            mean_handover_wait_ms=_ms(waits, None), p99_handover_wait_ms=_ms(waits, 0.99))

    def records(self) -> list:
        return [r.as_dict() for r in self.protocol.records]


def _ms(xs: list, q: float | None):
    """The mean (``q=None``) or the ``q`` quantile (nearest rank) of sorted seconds ``xs``, in
    ms; None if empty."""
    if not xs:
        return None
    if q is None:
        return 1e3 * sum(xs) / len(xs)
    return 1e3 * xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


__all__ = ["Disaggregated"]
