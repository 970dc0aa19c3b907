"""The simulator's face: ``Simulator`` builds replicas of one engine configuration (colocated,
or P prefill and D - P decode replicas) and runs a workload through the one event loop
(``paged.sim.event_loop``) under the matching fleet policy (``Colocated`` or
``paged.sim.disagg.Disaggregated``); ``SimResult`` is what a run returns.

A request's output length is forced: ``SamplingParams(max_tokens=output_len, ignore_eos=True)``.
Every result is labelled ``evidence: "simulated"``.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Mapping, Sequence

from paged.config.engine_config import EngineConfig
from paged.fleet.routing import Router
from paged.sim.disagg import Disaggregated
from paged.sim.event_loop import Colocated, run_fleet
from paged.sim.link_transport import LinkTransport
from paged.sim.records import EVIDENCE, STATUS, record_of, rejected_record
from paged.sim.replica import SimReplica
from paged.sim.step_model import StepTimeModel
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
      handover: a ``paged.sim.link_transport.LinkTransport`` (link and model), required when P > 0.
      decode_config: the decode replicas' ``EngineConfig`` (default ``config``); P > 0 only.
      host_link: the host-device link pricing each replica's host KV tier
        (``config.host_kv_cache_bytes > 0``; ``paged.sim.host_link``, default PCIe Gen5 x16).
    """

    def __init__(self, config: EngineConfig, step_model: StepTimeModel | Callable[[int], StepTimeModel],
                 *, num_replicas: int | None = None, router: Router | None = None,
                 model_config=None, build_device: bool = True, record_schedule: bool = False,
                 idle_wake_s: float = 0.0, fast_forward: bool = True,
                 prefill_replicas: int | None = None, handover: LinkTransport | None = None,
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
        """Serves ``workload`` (``paged.sim.event_loop.run_fleet`` has the keyword arguments:
        ``aborts``, ``timeout_s``, ``max_time_s``, ``ttft_slo_ms``, ``tpot_slo_ms``,
        ``on_progress``). Python's cyclic garbage collector is paused meanwhile (the run makes
        no reference cycles worth collecting, and its passes over the growing records made the
        wall time grow faster than the request count)."""
        P = self.prefill_replicas
        policy = Disaggregated(P, self.handover, self.config.seed) if P \
            else Colocated(len(self.replicas))
        enabled = gc.isenabled()
        gc.disable()
        cpu0 = time.process_time()
        try:
            res = SimResult(**run_fleet(self.replicas, self.router, policy, workload,
                                        idle_wake_s=self.idle_wake_s, **kw))
        finally:
            if enabled:
                gc.enable()
        res.cpu_s = time.process_time() - cpu0
        return res


def check_roles(num_replicas: int, prefill_replicas, handover, decode_config) -> None:
    """``Simulator``'s disaggregation settings: 0 <= P < num_replicas; a ``LinkTransport`` exactly
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
    if P and not isinstance(handover, LinkTransport):
        raise TypeError(f"prefill_replicas={P} needs handover=LinkTransport(link, model), got "
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
