"""The event loop of a disaggregated fleet: P prefill replicas hand each prompt's KV to D - P
decode replicas over a link (``Simulator(..., prefill_replicas=P, handover=...)``).

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
import heapq
import math
import time
from collections.abc import Callable, Mapping

from paged.request.checks import derive_seed
from paged.request.sampling import SamplingParams
from paged.request.sequence import UNKNOWN, Sequence
from paged.sim.records import close_records, fleet_summary, record_of, rejected_record
from paged.workload import metrics

STEP, STRETCH, WAKE, TRANSFER = 1, 2, 0, 3


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


class DisaggregatedRun:
    """One run of ``prefill`` and ``decode`` replicas (module docstring).

    Args:
      prefill, decode: the replicas (``SimReplica`` with roles "prefill" and "decode").
      router: routes arrivals among the prefill replicas.
      handover: prices each hand-over (``paged.sim.handover.Handover``).
      idle_wake_s: as ``Simulator``'s.
      seed: the engine seed (unseeded requests' sampling seeds derive from it and the request's
        index in the workload, so both sides agree).
    """

    def __init__(self, prefill, decode, router, handover, idle_wake_s: float, seed: int):
        self.prefill, self.decode = list(prefill), list(decode)
        self.reps = self.prefill + self.decode
        self.router, self.handover = router, handover
        self.wake, self.seed = idle_wake_s, seed

    def run(self, workload, *, aborts: Mapping[str, float] | None = None,
            timeout_s: float | None = None, max_time_s: float = math.inf,
            ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
            on_progress: Callable[[int], None] | None = None) -> dict:
        """Serves ``workload`` (``Simulator.run``'s arguments); returns ``SimResult``'s fields."""
        wall0 = time.perf_counter()
        specs = list(workload.requests)
        bad = [s.request_id for s in specs if s.n != 1]
        if bad:
            raise ValueError(f"requests {bad[:5]} ask for n > 1 samples; a disaggregated "
                             "simulation models n = 1 only")
        spec_of = {r.request_id: r for r in specs}
        index_of = {r.request_id: k for k, r in enumerate(specs)}
        abort_list = sorted((t, rid) for rid, t in (aborts or {}).items())
        reps, P = self.reps, len(self.prefill)
        D = len(self.decode)
        routed = [0] * len(reps)
        where: dict[str, tuple] = {}  # request id -> ("p", r) | ("h", handover) | ("d", r)
        records: dict[str, metrics.RequestRecord] = {}
        hands: list[_Handover] = []
        pending: collections.deque[_Handover] = collections.deque()
        reserved = [0] * D  # hand-overs in flight to each decode replica
        src_free = [0.0] * P  # each GPU's link is busy until then
        dst_free = [0.0] * D
        heap: list = []
        busy = [False] * len(reps)
        stretching: set[int] = set()
        order = 0
        rot = 0
        i = j = 0
        n = len(specs)
        inf = math.inf
        t = 0.0
        last_progress = 0
        ho = self.handover

        def push(when, r, kind, version):
            nonlocal order
            order += 1
            heapq.heappush(heap, (when, order, r, kind, version))

        def collect(r, outs, now):
            for out in outs:
                if not out.finished:
                    continue
                rid = out.request_id
                spec = spec_of[rid]
                if r < P and out.finish_reason == "length" and spec.output_len > 1:
                    handed(r, out, now)
                else:
                    records[rid] = record_of(out, spec.prompt_len)

        def handed(r, out, now):
            rid = out.request_id
            prompt = out.prompt_token_ids
            rep = reps[r]
            rep.hold_prompt(rid, prompt)
            spec = spec_of[rid]
            deadline = None if timeout_s is None else out.arrival_time + timeout_s
            h = _Handover(rid, spec, r, out, prompt, ho.nbytes(len(prompt), rep.page_size), now,
                          deadline)
            hands.append(h)
            pending.append(h)
            where[rid] = ("h", h)

        def cut(r, now, ready):
            stretching.discard(r)
            end = reps[r].advance_to(now)
            collect(r, reps[r].take_outputs(), now)
            if end is None:
                busy[r] = False
                ready.append(r)
            else:
                push(end, r, STEP, reps[r].version)

        def load(d):
            rep = self.decode[d]
            return rep.num_running + rep.num_waiting + reserved[d]

        def place(h, now, ready):
            """Reserves blocks for ``h`` on a decode replica; its index, or None."""
            nonlocal rot
            order_ = sorted(range(D), key=lambda d: (load(d), (d - rot) % D))
            for d in order_:
                rep = self.decode[d]
                if load(d) >= rep.config.max_num_seqs:
                    continue
                if P + d in stretching:
                    cut(P + d, now, ready)
                out = h.out
                seq = Sequence(rep.new_seq_id(), h.rid, list(h.prompt) + [UNKNOWN], len(h.prompt),
                               SamplingParams(max_tokens=h.spec.output_len, temperature=0.0,
                                              ignore_eos=True,
                                              seed=derive_seed(self.seed, index_of[h.rid])),
                               derive_seed(self.seed, index_of[h.rid]), out.arrival_time,
                               deadline=h.deadline)
                seq.set_sampled(len(h.prompt), h.first, out.first_token_time)
                seq.num_computed_tokens = len(h.prompt)
                if not rep.reserve_received(seq):
                    continue
                seq.first_scheduled_time = out.first_scheduled_time
                seq.first_token_time = out.first_token_time
                seq.num_cached_tokens = out.num_cached_tokens
                seq.num_preemptions = out.num_preemptions
                h.seq, h.dst = seq, d
                reserved[d] += 1
                rot = (d + 1) % D
                return d
            return None

        def dropped(h, status, now):
            out = h.out
            now = max(now, h.ready_s)
            records[h.rid] = metrics.RequestRecord(
                request_id=h.rid, status=status, arrival_s=out.arrival_time,
                first_scheduled_s=out.first_scheduled_time, first_token_s=out.first_token_time,
                finish_s=now, token_times=tuple(out.token_times), prompt_len=h.spec.prompt_len,
                output_len=len(out.token_ids), num_preemptions=out.num_preemptions,
                num_cached_tokens=out.num_cached_tokens)

        def try_handovers(now, ready):
            while pending:
                h = pending[0]
                if h.deadline is not None and now >= h.deadline:
                    pending.popleft()
                    reps[h.src].release_prompt(h.rid, 0)
                    dropped(h, "timeout", now)
                    continue
                d = place(h, now, ready)
                if d is None:
                    return
                pending.popleft()
                h.start_s = max(now, src_free[h.src], dst_free[d])
                h.end_s = h.start_s + ho.time(h.nbytes)
                src_free[h.src] = dst_free[d] = h.end_s
                push(h.end_s, -1, TRANSFER, h)

        def arrived(h, now, ready):
            d = h.dst
            r = P + d
            reserved[d] -= 1
            if h.aborted:
                self.decode[d].cancel_received(h.seq)
                reps[h.src].release_prompt(h.rid, 0)
                return
            if r in stretching:
                cut(r, now, ready)
            reps[h.src].release_prompt(h.rid, h.nbytes)
            self.decode[d].start_received(h.seq, h.nbytes)
            where[h.rid] = ("d", r)
            routed[r] += 1
            wake_up(r, now, ready)

        def wake_up(r, now, ready):
            if not busy[r]:
                if self.wake:
                    busy[r] = True
                    push(now + self.wake, r, WAKE, reps[r].version)
                else:
                    ready.append(r)

        def begin_ready(ready, t):
            """Every free replica of ``ready`` with work begins its next step (or stretch)."""
            for r in dict.fromkeys(ready):
                if busy[r]:
                    continue
                rep = reps[r]
                while rep.has_unfinished_requests() or rep.has_unreported_aborts:
                    end = rep.plan(t) if r >= P else None
                    if end is not None:
                        push(end, r, STRETCH, rep.version)
                        busy[r] = True
                        stretching.add(r)
                        break
                    dur, outs = rep.begin(t)
                    collect(r, outs, t)
                    if dur is not None:
                        push(t + dur, r, STEP, rep.version)
                        busy[r] = True
                        break

        while True:
            t_arr = specs[i].arrival_s if i < n else inf
            t_ab = abort_list[j][0] if j < len(abort_list) else inf
            t_ev = heap[0][0] if heap else inf
            t = min(t_arr, t_ab, t_ev)
            if t == inf or t > max_time_s:
                break
            ready = []
            while heap and heap[0][0] == t:
                _, _, r, kind, version = heapq.heappop(heap)
                if kind == TRANSFER:
                    arrived(version, t, ready)
                    continue
                rep = reps[r]
                if version != rep.version:
                    continue
                if kind == STEP:
                    collect(r, rep.finish(t), t)
                elif kind == STRETCH:
                    stretching.discard(r)
                    if rep.advance_to(t) is not None:
                        raise RuntimeError(f"{rep.name}: a stretch ended with a step in flight")
                    collect(r, rep.take_outputs(), t)
                busy[r] = False
                ready.append(r)
            while i < n and specs[i].arrival_s <= t:
                spec = specs[i]
                i += 1
                prompt = spec.engine_prompt()
                r = 0
                if P > 1:
                    ids = reps[0].tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                    r = self.router.route(ids, self.prefill)
                params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                        seed=derive_seed(self.seed, i - 1))
                try:
                    reps[r].add_request(spec.request_id, prompt, params,
                                        arrival_time=spec.arrival_s, timeout_s=timeout_s)
                except ValueError:
                    records[spec.request_id] = rejected_record(spec, spec.arrival_s)
                    continue
                routed[r] += 1
                where[spec.request_id] = ("p", r)
                wake_up(r, t, ready)
            while j < len(abort_list) and abort_list[j][0] <= t:
                rid = abort_list[j][1]
                j += 1
                if rid not in where or rid in records:
                    continue
                kind, at = where[rid]
                if kind == "h":
                    if at.start_s is None:  # still waiting: freed at once
                        pending.remove(at)
                        reps[at.src].release_prompt(rid, 0)
                    else:  # mid-transfer: freed when the copy ends
                        at.aborted = True
                    dropped(at, "aborted", t)
                    continue
                if at in stretching:
                    cut(at, t, ready)
                reps[at].abort(rid, t)
                if not busy[at]:
                    ready.append(at)
            if pending:
                try_handovers(t, ready)
            begin_ready(ready, t)
            if pending:  # an abort or timeout a step began with may have made room
                more = []
                try_handovers(t, more)
                begin_ready(more, t)
            if on_progress is not None and len(records) - last_progress >= 256:
                last_progress = len(records)
                on_progress(last_progress)
        for r in sorted(stretching):  # the time limit: the state at max_time_s
            reps[r].advance_to(max_time_s, begin_at_t=True)
            collect(r, reps[r].take_outputs(), max_time_s)
        end = min(t, max_time_s) if t != inf else max(
            [r.finish_s for r in records.values() if r.finish_s is not None], default=0.0)
        for h in hands:  # unfinished hand-overs at the time limit
            if h.rid not in records and (h.end_s is None or h.end_s > end):
                h.aborted = True
                dropped(h, "aborted", end)
        recs = close_records(reps, records, specs, end)
        summary, stats, steps = fleet_summary(recs, reps, workload, ttft_slo_ms, tpot_slo_ms)
        done = [h for h in hands if h.end_s is not None and not h.aborted]
        secs = sorted(h.end_s - h.start_s for h in done)
        waits = sorted(h.start_s - h.ready_s for h in done)
        summary.update(
            num_prefill_replicas=P, num_handovers=len(done), kv_transfer_bytes=sum(h.nbytes for h in done),
            mean_transfer_ms=_ms(secs, None), p99_transfer_ms=_ms(secs, 0.99),
            mean_handover_wait_ms=_ms(waits, None), p99_handover_wait_ms=_ms(waits, 0.99))
        if on_progress is not None:
            on_progress(len(records))
        schedule = [rep.schedule_log for rep in reps] if reps[0].schedule_log is not None \
            else None
        return {"records": recs, "summary": summary, "replicas": stats, "routed": routed,
                "router": dict(self.router.num_routed), "wall_s": time.perf_counter() - wall0,
                "sim_s": end, "num_steps": steps, "schedule": schedule,
                "handovers": [h.as_dict() for h in hands]}


def _ms(xs: list, q: float | None):
    """The mean (``q=None``) or the ``q`` quantile (nearest rank) of sorted seconds ``xs``, in
    ms; None if empty."""
    if not xs:
        return None
    if q is None:
        return 1e3 * sum(xs) / len(xs)
    return 1e3 * xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


__all__ = ["DisaggregatedRun"]
