"""The simulator's one discrete-event loop: arrivals, routing, serial steps per replica, in
simulated time, with the fleet's shape (colocated or disaggregated) as a policy plugged into it.

Events are kept in a ``heapq`` (step ends, wake-ups, the ends of planned decode stretches, and the
policy's own events such as a finished KV transfer) beside two sorted streams (arrivals, aborts);
there are no threads and nothing sleeps. At each event time ``t``, in this order (the order of the
real-time driver ``experiments/serving.py``, which adds every arrival due before it calls
``step()``):

1. replicas whose step ends at ``t`` read it back (``SimReplica.finish``), and the policy's
   events due at ``t`` run (``FleetPolicy.on_event``);
2. requests arriving at or before ``t`` are routed among the policy's first ``num_routable``
   replicas (``paged.fleet.routing.Router``) and added;
3. aborts due at ``t`` are applied;
4. the policy moves what waits on it (``before_begin``), every replica that is free and has work
   begins its next step at ``t`` (a replica that was idle when a request reached it begins
   ``idle_wake_s`` later, if that is set), and the policy looks again (``after_begin``).

A replica that would begin a pure decode step instead plans a stretch of them
(``SimReplica.plan``) and has one heap event at the stretch's end; a stretch that ends at a
finish with rows left goes on at once (``SimReplica.continue_at``: the next one is planned in
the same event, not through step 4). An arrival routed to it
mid-stretch shortens the stretch to the step in flight (``SimReplica.truncate``); an abort, the
time limit, a policy that reaches into it (``cut``), and a router that reads the block managers
(``prefix_aware``) unless the stretch cannot change the answer
(``SimReplica.prefix_query_unchanged``) apply it up to that moment (``SimReplica.advance_to``);
either way each replica's state at every event is the state stepping reaches (``tests/test_sim.py``
compares records, schedules and block-manager counters).

A fleet policy is an object with these members (``Colocated`` is the plain one;
``paged.sim.disagg.Disaggregated`` runs the hand-over protocol from prefill to decode replicas):

* ``num_routable``: arrivals are routed among replicas ``0 .. num_routable - 1``;
* ``check(specs)``: refuses a workload it cannot model (ValueError, before the run);
* ``bind(loop)``: called once before the run with this loop;
* ``params(spec, index)``: the ``SamplingParams`` a new request is added with;
* ``after_step(r, now)``: replica ``r`` read a step back (a prefill replica parks here);
* ``abort(rid, now) -> bool``: True if the policy handled the client's abort itself;
* ``on_event(payload, now, ready)``: one of its own heap events (``EventLoop.push_policy``);
* ``before_begin(now, ready)``, ``after_begin(now)``: around step 4;
* ``close(end)``, ``summarize(summary)``, ``records()``: the end of the run (its own records, or
  None).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Mapping

from paged.request.sampling import SamplingParams
from paged.sim.records import close_records, fleet_summary, record_of, rejected_record

WAKE, STEP, STRETCH, POLICY = 0, 1, 2, 3


class Colocated:
    """Every replica takes arrivals and serves each request to its end."""

    def __init__(self, num_replicas: int):
        self.num_routable = num_replicas
        self._params: dict[tuple[int, int], SamplingParams] = {}  # (output_len, n): one each

    def check(self, specs) -> None:
        pass

    def bind(self, loop) -> None:
        pass

    def params(self, spec, index: int) -> SamplingParams:
        params = self._params.get((spec.output_len, spec.n))
        if params is None:  # immutable: one per (output length, samples)
            params = self._params[spec.output_len, spec.n] = SamplingParams(
                max_tokens=spec.output_len, temperature=0.0, n=spec.n, ignore_eos=True)
        return params

    def after_step(self, r: int, now: float) -> None:
        pass

    def abort(self, rid: str, now: float) -> bool:
        return False

    def on_event(self, payload, now: float, ready: list) -> None:
        raise RuntimeError(f"a colocated fleet has no events of its own, got {payload!r}")

    def before_begin(self, now: float, ready: list) -> None:
        pass

    def after_begin(self, now: float) -> None:
        pass

    def close(self, end: float) -> None:
        pass

    def summarize(self, summary: dict) -> None:
        pass

    def records(self) -> list | None:
        return None


class EventLoop:
    """One run of ``replicas`` behind ``router`` under ``policy`` (module docstring).

    Attributes the policy may use: ``replicas``, ``records`` (request id -> ``RequestRecord``),
    ``where`` (request id -> the replica that holds it), ``routed`` (requests per replica),
    ``stretching`` (replicas with a planned stretch), ``spec_of``, ``index_of``, ``timeout_s``,
    and the methods ``push_policy``, ``cut``, ``wake_up``, ``begin_ready``.
    """

    def __init__(self, replicas, router, policy, *, idle_wake_s: float, workload,
                 aborts: Mapping[str, float] | None, timeout_s: float | None):
        self.replicas, self.router, self.policy = replicas, router, policy
        self.wake = idle_wake_s
        self.specs = list(workload.requests)
        policy.check(self.specs)
        self.spec_of = {r.request_id: r for r in self.specs}
        self.index_of = {r.request_id: k for k, r in enumerate(self.specs)}
        self.abort_list = sorted((t, rid) for rid, t in (aborts or {}).items())
        self.timeout_s = timeout_s
        n = len(replicas)
        self.routed = [0] * n
        self.where: dict[str, int] = {}
        self.records: dict = {}
        # (time, order, replica, kind, version or payload): a step-like event is stale when the
        # replica's version moved on; a POLICY event carries the policy's payload.
        self.heap: list = []
        self.order = 0
        self.busy = [False] * n
        self.stretching: set[int] = set()
        # What the router reads of each routable replica (waiting + running), refreshed before
        # an arrival for the replicas touched since the last one: a replica's queues change only
        # in the calls this loop (or the policy, through it) makes.
        self.loads = [0] * policy.num_routable
        self.touched: set[int] = set(range(n))
        self.reads_blocks = policy.num_routable > 1 and router.policy == "prefix_aware"
        policy.bind(self)

    # --- what the policy calls --------------------------------------------------------------
    def push(self, when: float, r: int, kind: int, version) -> None:
        self.order += 1
        heapq.heappush(self.heap, (when, self.order, r, kind, version))

    def push_policy(self, when: float, payload) -> None:
        """One of the policy's events: ``policy.on_event(payload, when, ready)`` at ``when``."""
        self.push(when, -1, POLICY, payload)

    def collect(self, r: int, outs, now: float) -> None:
        records, spec_of = self.records, self.spec_of
        for out in outs:
            if out.finished:
                rid = out.request_id
                records[rid] = record_of(out, spec_of[rid].prompt_len)

    def cut(self, r: int, now: float, ready: list) -> None:
        """Replica ``r``'s state at ``now`` mid-stretch: the step in flight resumes."""
        self.stretching.discard(r)
        self.touched.add(r)
        rep = self.replicas[r]
        end = rep.advance_to(now)
        self.collect(r, rep.take_outputs(), now)
        if end is None:  # its last step ended at ``now``: as a step end at ``now``
            self.busy[r] = False
            ready.append(r)
        else:
            self.push(end, r, STEP, rep.version)

    def wake_up(self, r: int, now: float, ready: list) -> None:
        """Replica ``r`` got work: it begins at once if free (or ``idle_wake_s`` later)."""
        if not self.busy[r]:
            if self.wake:  # idle: it wakes up a little later
                self.busy[r] = True
                self.push(now + self.wake, r, WAKE, self.replicas[r].version)
            else:
                ready.append(r)

    def begin_ready(self, ready: list, t: float) -> None:
        """Every free replica of ``ready`` with work begins its next step (or stretch)."""
        busy, reps = self.busy, self.replicas
        for r in dict.fromkeys(ready):
            if busy[r]:
                continue
            rep = reps[r]
            self.touched.add(r)
            while rep.has_unfinished_requests() or rep.has_unreported_aborts:
                end = rep.plan(t)
                if end is not None:
                    self.push(end, r, STRETCH, rep.version)
                    busy[r] = True
                    self.stretching.add(r)
                    break
                dur, outs = rep.begin(t)
                self.collect(r, outs, t)
                if dur is not None:
                    self.push(t + dur, r, STEP, rep.version)
                    busy[r] = True
                    break

    # --- the loop -----------------------------------------------------------------------------
    def pop_events(self, t: float) -> list:
        """Step ends, stretch ends, wake-ups and policy events at ``t``; the replicas now free."""
        heap, reps, ready = self.heap, self.replicas, []
        while heap and heap[0][0] == t:
            _, _, r, kind, version = heapq.heappop(heap)
            if kind == POLICY:
                self.policy.on_event(version, t, ready)
                continue
            rep = reps[r]
            if version != rep.version:
                continue
            self.touched.add(r)
            if kind == STEP:
                self.collect(r, rep.finish(t), t)
                self.policy.after_step(r, t)
            elif kind == STRETCH:
                if rep.advance_to(t) is not None:
                    raise RuntimeError(f"{rep.name}: a stretch ended with a step in flight")
                self.collect(r, rep.take_outputs(), t)
                end = rep.continue_at(t)  # through its finishes: the next stretch at once
                if end is not None:
                    self.push(end, r, STRETCH, rep.version)
                    continue
                self.stretching.discard(r)
            self.busy[r] = False
            ready.append(r)
        return ready

    def route(self, prompt, t: float, ready: list) -> int:
        """The routable replica an arrival at ``t`` goes to."""
        reps, K = self.replicas, self.policy.num_routable
        if K == 1:
            return 0
        ids = reps[0].tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if self.reads_blocks and self.stretching:  # the router reads every block manager
            for r in sorted(self.stretching):
                if r < K and not reps[r].prefix_query_unchanged(ids, t):
                    self.cut(r, t, ready)
        loads = self.loads
        for k in self.touched:
            if k < K:
                loads[k] = reps[k].num_waiting + reps[k].num_running
        self.touched.clear()
        return self.router.route(ids, reps[:K] if K < len(reps) else reps, loads=loads)

    def arrive(self, spec, index: int, t: float, ready: list) -> None:
        """Routes and adds one arriving request."""
        prompt = spec.engine_prompt()
        r = self.route(prompt, t, ready)
        rep = self.replicas[r]
        if r in self.stretching:  # it stops after the step in flight
            end = rep.truncate(t)
            self.collect(r, rep.take_outputs(), t)
            if end is None:
                self.stretching.discard(r)
                self.busy[r] = False
                ready.append(r)
            else:
                self.push(end, r, STRETCH, rep.version)
        params = self.policy.params(spec, index)
        self.touched.add(r)
        try:
            rep.add_request(spec.request_id, prompt, params, arrival_time=spec.arrival_s,
                            timeout_s=self.timeout_s)
        except ValueError:
            self.records[spec.request_id] = rejected_record(spec, spec.arrival_s)
            return
        self.routed[r] += 1
        self.where[spec.request_id] = r
        self.wake_up(r, t, ready)

    def abort(self, rid: str, t: float, ready: list) -> None:
        """The client's abort of ``rid`` at ``t``."""
        if rid not in self.where or self.policy.abort(rid, t):
            return
        r = self.where[rid]
        self.touched.add(r)
        if r in self.stretching:
            self.cut(r, t, ready)
        self.replicas[r].abort(rid, t)
        if not self.busy[r]:
            ready.append(r)

    def run(self, max_time_s: float, on_progress: Callable[[int], None] | None) -> float:
        """Runs to the last event or ``max_time_s``; returns the end time."""
        specs, aborts, heap, policy = self.specs, self.abort_list, self.heap, self.policy
        i = j = 0
        n = len(specs)
        inf = math.inf
        t = 0.0
        last_progress = 0
        while True:
            t_arr = specs[i].arrival_s if i < n else inf
            t_ab = aborts[j][0] if j < len(aborts) else inf
            t_ev = heap[0][0] if heap else inf
            t = min(t_arr, t_ab, t_ev)
            if t == inf or t > max_time_s:
                break
            ready = self.pop_events(t) if t_ev == t else []
            while i < n and specs[i].arrival_s <= t:
                i += 1
                self.arrive(specs[i - 1], i - 1, t, ready)
            while j < len(aborts) and aborts[j][0] <= t:
                j += 1
                self.abort(aborts[j - 1][1], t, ready)
            policy.before_begin(t, ready)
            self.begin_ready(ready, t)
            policy.after_begin(t)
            if on_progress is not None and len(self.records) - last_progress >= 256:
                last_progress = len(self.records)
                on_progress(last_progress)
        for r in sorted(self.stretching):  # the time limit: the state at max_time_s
            self.replicas[r].advance_to(max_time_s, begin_at_t=True)
            self.collect(r, self.replicas[r].take_outputs(), max_time_s)
        return min(t, max_time_s) if t != inf else max(
            [r.finish_s for r in self.records.values() if r.finish_s is not None], default=0.0)


def run_fleet(replicas, router, policy, workload, *, idle_wake_s: float = 0.0,
              aborts: Mapping[str, float] | None = None, timeout_s: float | None = None,
              max_time_s: float = math.inf, ttft_slo_ms: float | None = None,
              tpot_slo_ms: float | None = None,
              on_progress: Callable[[int], None] | None = None) -> dict:
    """Serves ``workload`` on ``replicas`` under ``policy``; returns ``SimResult``'s fields.

    Args:
      replicas, router, policy: the fleet (module docstring).
      workload: the requests (arrival offsets are simulated seconds from 0).
      idle_wake_s: an idle replica starts the step for a new arrival this much later.
      aborts: request id -> simulated time at which the client aborts it.
      timeout_s: per-request timeout (default the config's ``request_timeout_s``).
      max_time_s: simulated time limit: requests unfinished then are aborted, later arrivals
        rejected (all stay in the records).
      ttft_slo_ms, tpot_slo_ms: SLO for goodput.
      on_progress: called with the number of requests finished so far, now and then.
    """
    wall0 = time.perf_counter()
    loop = EventLoop(replicas, router, policy, idle_wake_s=idle_wake_s, workload=workload,
                     aborts=aborts, timeout_s=timeout_s)
    end = loop.run(max_time_s, on_progress)
    policy.close(end)
    recs = close_records(replicas, loop.records, loop.specs, end)
    summary, stats, steps = fleet_summary(recs, replicas, workload, ttft_slo_ms, tpot_slo_ms)
    policy.summarize(summary)
    if on_progress is not None:
        on_progress(len(loop.records))
    return {"records": recs, "summary": summary, "replicas": stats, "routed": loop.routed,
            "router": dict(router.num_routed), "wall_s": time.perf_counter() - wall0,
            "sim_s": end, "num_steps": steps,
            "schedule": [rep.schedule_log for rep in replicas]
            if replicas[0].schedule_log is not None else None,
            "handovers": policy.records()}


__all__ = ["POLICY", "STEP", "STRETCH", "WAKE", "Colocated", "EventLoop", "run_fleet"]
