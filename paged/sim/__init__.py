"""Discrete-event simulation of serving: the real scheduler and block manager, a modelled device.

* ``paged.sim.step_model``: ``StepShape`` and the ``StepTimeModel`` interface; its families in
  ``paged.sim.linear_model`` (fitted), ``paged.sim.roofline`` (analytic, over the device and model
  figures of ``paged.sim.specs``) and ``paged.sim.measured`` (measured noise, replay).
* ``paged.sim.replica``: ``SimReplica``, an engine replica running the real host code
  (``Scheduler``, ``BlockManager``, ``InputBatch``, ``BatchBuilder``, ``StepReader`` and the
  engine's request bookkeeping) with the device step replaced by the model; stretches of pure
  decode steps are planned and applied in bulk where that is exact (fast-forward).
* ``paged.sim.simulator``: ``Simulator``, replicas behind a ``paged.fleet.routing.Router`` run
  by the one event loop (``paged.sim.event_loop``), colocated or disaggregated
  (``paged.sim.disagg``: the hand-over protocol over a ``paged.sim.link_transport`` link);
  results are labelled ``evidence: "simulated"``.
* ``paged.sim.host_link``: ``HostLink`` (PCIe Gen5 x16, NVLink-C2C) and ``TierPricer``, the
  seconds of a replica's host KV tier copies (``EngineConfig(host_kv_cache_bytes=N)``).
"""

from paged.sim.batches import light_batch, pseudo_tokens
from paged.sim.linear_model import LinearStepModel, fit_linear, load_model_json
from paged.sim.measured import NoisyStepModel, ReplayStepModel
from paged.sim.replica import SimReplica
from paged.sim.roofline import RooflineStepModel
from paged.sim.simulator import (
    EVIDENCE,
    SimResult,
    Simulator,
    check_not_mixed,
    simulate,
)
from paged.sim.specs import H200, LLAMA3_8B, QWEN25_7B, DeviceSpec, ModelDims
from paged.sim.step_model import StepShape, StepTimeModel

__all__ = ["EVIDENCE", "H200", "LLAMA3_8B", "QWEN25_7B", "DeviceSpec", "LinearStepModel",
           "ModelDims", "NoisyStepModel", "ReplayStepModel", "RooflineStepModel", "SimReplica", "SimResult",
           "Simulator", "StepShape", "StepTimeModel", "check_not_mixed", "fit_linear",
           "light_batch", "load_model_json", "pseudo_tokens", "simulate"]
