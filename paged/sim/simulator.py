"""The discrete-event loop: arrivals, routing, serial steps per replica, in simulated time.

Events are kept in a ``heapq`` (step ends) beside two sorted streams (arrivals, aborts); there are
no threads and nothing sleeps. At each event time ``t``, in this order (the order of the real-time
driver ``experiments/serving.py``, which adds every arrival due before it calls ``step()``):

1. replicas whose step ends at ``t`` read it back (``SimReplica.finish``);
2. requests arriving at or before ``t`` are routed (``paged.fleet.routing.Router``) and added;
3. aborts due at ``t`` are applied;
4. every replica that is free and has work begins its next step at ``t`` (a replica that was
   idle when a request reached it begins ``idle_wake_s`` later, if that is set).

A replica that would begin a pure decode step instead plans a stretch of them
(``SimReplica.plan``) and has one heap event at the stretch's end. An arrival routed to it
mid-stretch shortens the stretch to the step in flight (``SimReplica.truncate``); an abort, the
time limit, and a router that reads the block managers (``prefix_aware``) unless the stretch
cannot change the answer (``SimReplica.prefix_query_unchanged``) apply it up to that moment
(``SimReplica.advance_to``); either way each replica's state at every event is the state
stepping reaches (``tests/test_sim.py`` compares records, schedules and block-manager counters).

A request's output length is forced: ``SamplingParams(max_tokens=output_len, ignore_eos=True)``.
Every result is labelled ``evidence: "simulated"``.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence

from paged.config.engine_config import EngineConfig
from paged.fleet.routing import Router
from paged.request.sampling import SamplingParams
from paged.sim.disagg import DisaggregatedRun
from paged.sim.handover import Handover
from paged.sim.records import (
    EVIDENCE,
    STATUS,
    close_records,
    fleet_summary,
    record_of,
    rejected_record,
)
from paged.sim.replica import SimReplica
from paged.sim.step_model import StepTimeModel
from paged.workload import metrics
from paged.workload.workload import Workload


@dataclasses.dataclass
class SimResult:
    """A simulated run.

    Attributes:
      records: one ``RequestRecord`` per request, in workload order (simulated seconds).
      summary: ``paged.workload.metrics.summarize`` of them plus fleet counters; ``evidence`` is
        ``"simulated"``.
      replicas: ``SimReplica.stats()`` per replica.
      routed: requests routed to each replica.
      router: decisions per kind (``Router.num_routed``).
      wall_s: wall time of the simulation itself.
      cpu_s: CPU time of this process during it (on a machine other jobs share, the wall time
        also holds the time they took the cores).
      sim_s: simulated time at the end.
      num_steps: steps over all replicas.
      schedule: per replica, its schedule log (``record_schedule=True``), else None.
      handovers: a disaggregated run's hand-overs, one dict each (``paged.sim.disagg``); None
        for colocated replicas.
    """

    records: list
    summary: dict
    replicas: list
    routed: list
    router: dict
    wall_s: float
    sim_s: float
    num_steps: int
    schedule: list | None = None
    evidence: str = EVIDENCE
    cpu_s: float | None = None
    handovers: list | None = None

    def to_json(self, *, with_records: bool = False) -> dict:
        out = {"evidence": self.evidence, "summary": self.summary, "replicas": self.replicas,
               "routed": self.routed, "router": self.router, "wall_s": self.wall_s,
               "sim_s": self.sim_s, "num_steps": self.num_steps, "cpu_s": self.cpu_s}
        if with_records:
            out["records"] = [r.as_dict() for r in self.records]
        if self.handovers is not None:
            out["handovers"] = self.handovers
        return out


class Simulator:
    """Replicas of one engine configuration behind a router, in simulated time.

    Args:
      config: every replica's ``EngineConfig``.
      step_model: one ``StepTimeModel`` shared by the replicas, or a callable ``index -> model``
        (a model with state, such as ``ReplayStepModel``, needs one per replica).
      num_replicas: >= 1 (default 1, or ``config.data_parallel_size`` when P comes from
        ``config.prefill_replicas``).
      router: a ``paged.fleet.routing.Router`` (default least loaded).
      model_config: passed to each ``SimReplica`` (vocabulary, prefix-cache salt).
      build_device: build the real padded device batch every step (``SimReplica``).
      record_schedule: keep each replica's schedule log.
      idle_wake_s: an idle replica starts the step for a new arrival this much later (a
        real-time driver sleeping until the arrival wakes late; ``experiments/calibrate.py``
        measures it as ``sleep_overshoot_s``). 0: at once.
      fast_forward: let replicas plan stretches of pure decode steps and apply them in bulk
        (``SimReplica.plan``; only with ``build_device=False`` and a stateless step model); the
        results are those of stepping.
      prefill_replicas: P > 0 disaggregates: replicas ``0 .. P-1`` only prefill (prompt and
        first token; routed to by ``router``), ``P .. num_replicas-1`` only decode, and each
        prompt's KV is handed over (``paged.sim.disagg``). 0: colocated replicas. Default
        ``config.prefill_replicas`` (the engine's own setting). ``step_model``
        as a callable gives each role its own model (by replica index).
      handover: a ``paged.sim.handover.Handover`` (link and model), required when P > 0.
      decode_config: the decode replicas' ``EngineConfig`` (default ``config``); P > 0 only.
      host_link: the host-device link pricing each replica's host KV tier
        (``config.host_kv_cache_bytes > 0``; ``paged.sim.host_link``, default PCIe Gen5 x16).
    """

    def __init__(self, config: EngineConfig, step_model: StepTimeModel | Callable[[int], StepTimeModel],
                 *, num_replicas: int | None = None, router: Router | None = None,
                 model_config=None, build_device: bool = True, record_schedule: bool = False,
                 idle_wake_s: float = 0.0, fast_forward: bool = True,
                 prefill_replicas: int | None = None, handover: Handover | None = None,
                 decode_config: EngineConfig | None = None, host_link=None):
        if prefill_replicas is None:  # the engine's own setting: EngineConfig(D, prefill_replicas=P)
            prefill_replicas = config.prefill_replicas
            if prefill_replicas and num_replicas is None:
                num_replicas = config.data_parallel_size
        if num_replicas is None:
            num_replicas = 1
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas!r} must be an int >= 1")
        check_roles(num_replicas, prefill_replicas, handover, decode_config)
        make = step_model if callable(step_model) and not isinstance(step_model, StepTimeModel) \
            else (lambda i: step_model)
        if not (idle_wake_s >= 0 and math.isfinite(idle_wake_s)):
            raise ValueError(f"idle_wake_s={idle_wake_s!r} must be finite and >= 0")
        self.idle_wake_s = float(idle_wake_s)
        self.config = config
        self.router = router or Router("least_loaded")
        self.prefill_replicas, self.handover = prefill_replicas, handover
        P = prefill_replicas
        if not P:
            self.replicas = [SimReplica(config, make(i), model_config=model_config,
                                        build_device=build_device, record_schedule=record_schedule,
                                        name=f"replica{i}", fast_forward=fast_forward,
                                        host_link=host_link)
                             for i in range(num_replicas)]
            return
        dcfg = decode_config or config
        self.replicas = [
            SimReplica(config if i < P else dcfg, make(i), model_config=model_config,
                       build_device=build_device, record_schedule=record_schedule,
                       name=f"prefill{i}" if i < P else f"decode{i - P}",
                       fast_forward=fast_forward and i >= P, role="prefill" if i < P else "decode",
                       host_link=host_link)
            for i in range(num_replicas)]

    def run(self, workload: Workload, **kw) -> SimResult:
        """Serves ``workload``; see ``_run`` for the arguments. Python's cyclic garbage collector
        is paused meanwhile (the run makes no reference cycles worth collecting, and its passes
        over the growing records made the wall time grow faster than the request count)."""
        enabled = gc.isenabled()
        gc.disable()
        cpu0 = time.process_time()
        try:
            if self.prefill_replicas:
                P = self.prefill_replicas
                res = SimResult(**DisaggregatedRun(
                    self.replicas[:P], self.replicas[P:], self.router, self.handover,
                    self.idle_wake_s, self.config.seed).run(workload, **kw))
            else:
                res = self._run(workload, **kw)
        finally:
            if enabled:
                gc.enable()
        res.cpu_s = time.process_time() - cpu0
        return res

    def _run(self, workload: Workload, *, aborts: Mapping[str, float] | None = None,
            timeout_s: float | None = None, max_time_s: float = math.inf,
            ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
            on_progress: Callable[[int], None] | None = None) -> SimResult:
        """Serves ``workload`` (arrival offsets are simulated seconds from 0).

        Args:
          workload: the requests.
          aborts: request id -> simulated time at which the client aborts it.
          timeout_s: per-request timeout (default the config's ``request_timeout_s``).
          max_time_s: simulated time limit: requests unfinished then are aborted, later arrivals
            rejected (all stay in the records).
          ttft_slo_ms, tpot_slo_ms: SLO for goodput.
          on_progress: called with the number of requests finished so far, now and then.
        """
        wall0 = time.perf_counter()
        specs = list(workload.requests)
        spec_of = {r.request_id: r for r in specs}
        abort_list = sorted((t, rid) for rid, t in (aborts or {}).items())
        reps, router = self.replicas, self.router
        routed = [0] * len(reps)
        where: dict[str, int] = {}
        records: dict[str, metrics.RequestRecord] = {}
        # (time, order, replica, kind, version): kind 0 wake-up, 1 step end, 2 end of a planned
        # decode stretch (``SimReplica.plan``; stale when the replica's version moved on).
        heap: list[tuple[float, int, int, int, int]] = []
        busy = [False] * len(reps)
        wake = self.idle_wake_s
        order = 0
        i = j = 0
        n = len(specs)
        inf = math.inf
        t = 0.0
        last_progress = 0
        reads_blocks = len(reps) > 1 and router.policy == "prefix_aware"
        stretching: set[int] = set()  # replicas with a planned stretch
        # What the router reads of each replica (waiting + running), refreshed before an arrival
        # for the replicas touched since the last one: a replica's queues change only in the
        # calls this loop makes (a planned stretch changes them when it is applied).
        loads = [0] * len(reps)
        touched: set[int] = set(range(len(reps)))
        params_of: dict[tuple[int, int], SamplingParams] = {}  # (output_len, n): one each

        def collect(outs):
            for out in outs:
                if out.finished:
                    rid = out.request_id
                    records[rid] = record_of(out, spec_of[rid].prompt_len)

        def cut(r, now, ready):
            """Replica ``r``'s state at ``now`` mid-stretch: the step in flight resumes."""
            nonlocal order
            stretching.discard(r)
            touched.add(r)
            end = reps[r].advance_to(now)
            collect(reps[r].take_outputs())
            if end is None:  # its last step ended at ``now``: as a step end at ``now``
                busy[r] = False
                ready.append(r)
            else:
                order += 1
                heapq.heappush(heap, (end, order, r, 1, reps[r].version))

        while True:
            t_arr = specs[i].arrival_s if i < n else inf
            t_ab = abort_list[j][0] if j < len(abort_list) else inf
            t_step = heap[0][0] if heap else inf
            t = min(t_arr, t_ab, t_step)
            if t == inf or t > max_time_s:
                break
            ready = []
            while heap and heap[0][0] == t:
                _, _, r, kind, version = heapq.heappop(heap)
                rep = reps[r]
                if version != rep.version:
                    continue
                touched.add(r)
                if kind == 1:
                    collect(rep.finish(t))
                elif kind == 2:
                    stretching.discard(r)
                    if rep.advance_to(t) is not None:
                        raise RuntimeError(f"{rep.name}: a stretch ended with a step in flight")
                    collect(rep.take_outputs())
                busy[r] = False
                ready.append(r)
            while i < n and specs[i].arrival_s <= t:
                spec = specs[i]
                i += 1
                prompt = spec.engine_prompt()
                if len(reps) > 1:
                    ids = reps[0].tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                    if reads_blocks and stretching:  # the router reads every block manager
                        for r in sorted(stretching):
                            if not reps[r].prefix_query_unchanged(ids, t):
                                cut(r, t, ready)
                    for k in touched:
                        loads[k] = reps[k].num_waiting + reps[k].num_running
                    touched.clear()
                    r = router.route(ids, reps, loads=loads)
                else:
                    r = 0
                if r in stretching:  # it stops after the step in flight
                    end = reps[r].truncate(t)
                    collect(reps[r].take_outputs())
                    if end is None:
                        stretching.discard(r)
                        busy[r] = False
                        ready.append(r)
                    else:
                        order += 1
                        heapq.heappush(heap, (end, order, r, 2, reps[r].version))
                params = params_of.get((spec.output_len, spec.n))
                if params is None:  # immutable: one per (output length, samples)
                    params = params_of[spec.output_len, spec.n] = SamplingParams(
                        max_tokens=spec.output_len, temperature=0.0, n=spec.n, ignore_eos=True)
                touched.add(r)
                try:
                    reps[r].add_request(spec.request_id, prompt, params, arrival_time=spec.arrival_s,
                                        timeout_s=timeout_s)
                except ValueError:
                    records[spec.request_id] = rejected_record(spec, spec.arrival_s)
                    continue
                routed[r] += 1
                where[spec.request_id] = r
                if not busy[r]:
                    if wake:  # idle: it wakes up a little later
                        busy[r] = True
                        order += 1
                        heapq.heappush(heap, (t + wake, order, r, 0, reps[r].version))
                    else:
                        ready.append(r)
            while j < len(abort_list) and abort_list[j][0] <= t:
                rid = abort_list[j][1]
                j += 1
                if rid in where:
                    r = where[rid]
                    touched.add(r)
                    if r in stretching:
                        cut(r, t, ready)
                    reps[r].abort(rid, t)
                    if not busy[r]:
                        ready.append(r)
            for r in dict.fromkeys(ready):
                if busy[r]:
                    continue
                rep = reps[r]
                touched.add(r)
                while rep.has_unfinished_requests() or rep.has_unreported_aborts:
                    end = rep.plan(t)
                    if end is not None:
                        order += 1
                        heapq.heappush(heap, (end, order, r, 2, rep.version))
                        busy[r] = True
                        stretching.add(r)
                        break
                    dur, outs = rep.begin(t)
                    collect(outs)
                    if dur is not None:
                        order += 1
                        heapq.heappush(heap, (t + dur, order, r, 1, rep.version))
                        busy[r] = True
                        break
            if on_progress is not None and len(records) - last_progress >= 256:
                last_progress = len(records)
                on_progress(last_progress)
        for r in sorted(stretching):  # the time limit: the state at max_time_s
            reps[r].advance_to(max_time_s, begin_at_t=True)
            collect(reps[r].take_outputs())
        end = min(t, max_time_s) if t != inf else max(
            [r.finish_s for r in records.values() if r.finish_s is not None], default=0.0)
        recs = close_records(reps, records, specs, end)
        summary, stats, steps = fleet_summary(recs, reps, workload, ttft_slo_ms, tpot_slo_ms)
        if on_progress is not None:
            on_progress(len(records))
        return SimResult(records=recs, summary=summary, replicas=stats, routed=routed,
                         router=dict(router.num_routed), wall_s=time.perf_counter() - wall0,
                         sim_s=end, num_steps=steps,
                         schedule=[rep.schedule_log for rep in reps]
                         if reps[0].schedule_log is not None else None)

def check_roles(num_replicas: int, prefill_replicas, handover, decode_config) -> None:
    """``Simulator``'s disaggregation settings: 0 <= P < num_replicas; a ``Handover`` exactly
    when P > 0; ``decode_config`` only then (ValueError / TypeError before anything is built)."""
    P = prefill_replicas
    if isinstance(P, bool) or not isinstance(P, int) or P < 0:
        raise ValueError(f"prefill_replicas={P!r} must be an int >= 0")
    if P and P >= num_replicas:
        raise ValueError(f"prefill_replicas={P} must be below num_replicas={num_replicas} "
                         "(at least one decode replica)")
    if not P and (handover is not None or decode_config is not None):
        raise ValueError("handover / decode_config set with prefill_replicas=0: roles need "
                         "prefill_replicas >= 1")
    if P and not isinstance(handover, Handover):
        raise TypeError(f"prefill_replicas={P} needs handover=Handover(link, model), got "
                        f"{type(handover).__name__}")
    if decode_config is not None and not isinstance(decode_config, EngineConfig):
        raise TypeError(f"decode_config must be an EngineConfig, got "
                        f"{type(decode_config).__name__}")


def simulate(config: EngineConfig, step_model, workload: Workload, **kw) -> SimResult:
    """``Simulator(config, step_model, ...).run(workload, ...)``: keyword arguments go to the
    one that takes them."""
    init = {k: kw.pop(k) for k in ("num_replicas", "router", "model_config", "build_device",
                                   "record_schedule", "idle_wake_s", "fast_forward",
                                   "prefill_replicas", "handover", "decode_config",
                                   "host_link") if k in kw}
    return Simulator(config, step_model, **init).run(workload, **kw)


def check_not_mixed(results: Sequence[Mapping]) -> str:
    """The one evidence label of ``results`` (dicts with ``"evidence"``); ValueError if a
    simulated result sits with a real or constructed one (``paged.workload.workload.check_same_evidence``)."""
    from paged.workload.workload import check_same_evidence

    return check_same_evidence(results)


__all__ = ["EVIDENCE", "STATUS", "SimResult", "Simulator", "check_not_mixed", "check_roles", "record_of",
           "rejected_record", "simulate"]
