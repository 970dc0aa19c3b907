"""Data-parallel replicas behind one ``Engine`` API.

``Engine(EngineConfig(data_parallel_size=D, tensor_parallel_size=T))`` builds a
``DataParallelEngine`` (``Engine`` is the factory; it passes itself as ``replica_factory``, so this
module never imports ``paged.engine.engine``): D replicas, each an ``Engine`` on its own T devices
(``paged.engine.placement``)
with its own KV pool, block manager, scheduler and input batch, and a ``paged.fleet.routing.Router``
that sends each new request to one of them. The router reads only host state: each replica's
queue sizes and its prefix-cache index (``BlockManager.cached_prefix_tokens``).

One ``step()`` dispatches every replica's next device call (``Engine.dispatch_step``) before it
waits on any (``Engine.finish_step``, replica order). JAX dispatch is asynchronous, so the D
devices compute concurrently while the host moves on to the next replica. What the host still
serialises: each replica's scheduling, batch build and dispatch, then each replica's read-back
(sampled tokens, stops, outputs), one replica after the other on one Python thread. With
``async_scheduling`` a replica's read-back waits for the step dispatched in the previous call,
which ran while the host served the other replicas; without it, for the step just dispatched.
``paged.server.replica_process.process_replicas`` builds the same engine with each replica's host
half in a process of its own (``ProcessReplica`` as the ``replica_factory``), so the host halves
run at the same time on as many cores; in-process replicas stay the default.

With ``prefill_replicas = P > 0`` the first P replicas only prefill and the other D - P only
decode: a request is routed (prefix-aware by default) among the prefill replicas, computes its
prompt and first token there, and is handed with its KV pages to a decode replica at the end of
that step (``paged.fleet.handover``). Prefill replicas read each step back before the next is
scheduled (``async_scheduling`` off there), so a request's first token is known, and the request
handed over, before its replica could schedule a decode for it.

Requests keep their engine-wide identity: request ids are unique across replicas, and an unseeded
request's seed derives from the engine's seed and its arrival order over the whole engine (as in a
single engine), so which replica serves a request does not change its samples.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from paged.accounting.formulas import ModelSpec
from paged.config.engine_config import EngineConfig, engine_config
from paged.config.support import check_supported
from paged.engine.generate import generate
from paged.engine.multihost import spans_processes
from paged.engine.placement import split_devices
from paged.engine.spec_decode import SpecStats
from paged.fleet.handover import HandOver
from paged.fleet.routing import EngineReplica, Router
from paged.request.checks import check_request, derive_seed
from paged.workload.metrics import StepTiming

log = logging.getLogger(__name__)

# kv_stats() keys that describe the geometry (equal across replicas), not amounts to add up.
_SAME = frozenset({"kv_layout", "layout", "dtype", "block_size", "bytes_per_block"})
# Per-replica keys that describe one replica only (dropped from the merged totals).
_OWN = ("role", "num_parked")


class DataParallelEngine:
    """``Engine``'s API over ``config.data_parallel_size`` replicas (see the module docstring).

    Composition, not a subclass: it holds D replica engines and a router, and implements the
    same public protocol (``add_request``, ``check_request`` / ``add_checked``, ``abort``,
    ``step``, ``generate``, ``has_unfinished_requests``, ``has_step_in_flight``,
    ``unfinished_request_ids``, ``warmup``, ``kv_stats``, ``spec_decode_stats``,
    ``num_compilations``, ``set_device_step``, ``record_steps``, ``reset_prefix_cache``).

    Args:
      config: the engine settings (``data_parallel_size`` > 1).
      replica_factory: builds one replica: ``replica_factory(config, model_config=...,
        params=..., devices=...)`` (``Engine`` passes itself).
      model_config, params, devices: as ``Engine``'s.

    Attributes:
      replicas: the replica engines, in device order (replica i runs on devices
        ``[i * T, (i + 1) * T)`` of the device list).
      router: the ``paged.fleet.routing.Router`` choosing each request's replica (among the
        prefill replicas when ``prefill_replicas > 0``).
      routed: request id -> the replica it was routed to, for every request ever added (a study
        reads where its requests went from here).
      roles: per replica, "prefill", "decode" or "both" (``prefill_replicas = 0``).
      handover: the ``paged.fleet.handover.HandOver`` moving prefilled requests to decode replicas
        (its ``records``: one per hand-over), or ``None`` without roles.

    Raises:
      ValueError: D x T more than the devices, KV heads not divisible by T, a ``mesh=`` (it names
        one replica's devices), a pair of mechanisms `paged.config.support` refuses (prefill
        replicas with a sliding or mixed model, or over several processes, ...), or anything a
        single engine refuses.
    """

    def __init__(self, config: EngineConfig | None = None, *, replica_factory, model_config=None,
                 params=None, mesh=None, devices=None):
        config = engine_config(config, jax.default_backend())
        if mesh is not None:
            raise ValueError("mesh= places one replica; with data_parallel_size > 1 pass devices=")
        if (model_config is None) != (params is None):
            raise ValueError("pass both model_config and params, or neither")
        if model_config is None:  # loaded once, placed by each replica
            from paged.models.registry import load_any

            model_config, params, _ = load_any(config.model, dtype=config.dtype,
                                               max_model_len=config.max_model_len)
        devices = jax.devices() if devices is None else devices
        check_supported(config, model_config, processes=spans_processes(devices))
        groups = split_devices(devices,
                               config.data_parallel_size, config.tensor_parallel_size,
                               model_config.num_kv_heads)
        one = dataclasses.replace(config, data_parallel_size=1, prefill_replicas=0)
        p = config.prefill_replicas
        # A prefill replica reads each step back before scheduling the next (module docstring).
        prefill = dataclasses.replace(one, async_scheduling=False)
        self.roles = ["prefill"] * p + ["decode"] * (len(groups) - p) if p else ["both"] * len(groups)
        self.config = config
        self.replicas = [replica_factory(prefill if role == "prefill" else one,
                                         model_config=model_config, params=params, devices=g)
                         for g, role in zip(groups, self.roles)]
        first = self.replicas[0]
        self.model_config, self.tokenizer, self.page_size = (
            first.model_config, first.tokenizer, first.page_size)
        self.vocab_size = model_config.vocab_size
        self.router = Router(config.router, config.router_load_threshold)
        # New requests go to the prefill replicas (all replicas when there are no roles).
        self._entry = [i for i, r in enumerate(self.roles) if r != "decode"]
        self._views = [_router_view(self.replicas[i]) for i in self._entry]
        self.handover = None
        if p:
            spec = ModelSpec.from_model_config(
                model_config, dtype=config.dtype, kv_cache_dtype=config.kv_cache_dtype,
                scale_granularity=config.kv_scale_granularity,
                page_bounds=config.sparse_decode is not None)
            self.handover = HandOver(self.replicas, self.roles,
                                     Router(config.router, config.router_load_threshold), spec)
        self._requests: dict[str, int] = {}  # unfinished or unreported request -> its replica
        self.routed: dict[str, int] = {}
        self._num_requests = 0
        self.num_steps = 0
        self.last_timing = StepTiming()
        self.step_record: list[dict] | None = None  # record_steps()
        self._traces_at_start = self._trace_count()

    def _trace_count(self) -> int:
        return self.replicas[0].trace_count()

    # --- requests -----------------------------------------------------------------------
    @property
    def cache_salt(self) -> bytes:
        return self.replicas[0].cache_salt

    @property
    def num_requests(self) -> int:
        """Requests ever added, over all replicas."""
        return self._num_requests

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is unfinished (or finished and unreported) on some replica."""
        return request_id in self._requests

    def add_request(self, request_id, prompt, params=None, *, arrival_time=None, timeout_s=None,
                    cache_salt=None) -> None:
        """``Engine.add_request``: checked, then routed to one replica."""
        self.add_checked(self.check_request(request_id, prompt, params,
                                            arrival_time=arrival_time, timeout_s=timeout_s,
                                            cache_salt=cache_salt))

    def check_request(self, request_id, prompt, params=None, *, arrival_time=None,
                      timeout_s=None, cache_salt=None) -> tuple:
        """``Engine.check_request`` over the whole engine (request ids unique across replicas)."""
        return check_request(self, request_id, prompt, params, arrival_time, timeout_s,
                             cache_salt)

    def add_checked(self, checked: tuple, *, seed=None) -> None:
        """Routes a checked request to a replica and adds it there; an unseeded request's seed
        derives from the engine's seed and its arrival order over the whole engine."""
        request_id, token_ids, cache_salt = checked[0], checked[1], checked[5]
        i = self._entry[self.router.route(token_ids, self._views, cache_salt)]
        if seed is None:
            seed = derive_seed(self.config.seed, self._num_requests)
        self.replicas[i].add_checked(checked, seed=seed)
        self._requests[request_id] = i
        self.routed[request_id] = i
        self._num_requests += 1

    def replica_of(self, request_id: str) -> int | None:
        """The replica serving an unfinished (or finished and unreported) request."""
        return self._requests.get(request_id)

    def abort(self, request_id: str) -> bool:
        """``Engine.abort`` on the request's replica (its blocks are freed there; a request
        parked for a hand-over is aborted on its prefill replica, one handed over on its decode
        replica)."""
        i = self._requests.get(request_id)
        if i is None:
            log.warning("abort(%r): no unfinished request with this id", request_id)
            return False
        return self.replicas[i].abort(request_id)

    def unfinished_request_ids(self) -> list[str]:
        return [r for e in self.replicas for r in e.unfinished_request_ids()]

    def has_unfinished_requests(self) -> bool:
        """``Engine.has_unfinished_requests`` of any replica (a step in flight counts)."""
        return (any(e.has_unfinished_requests() for e in self.replicas)
                or self.handover is not None and self.handover.busy)

    def has_step_in_flight(self) -> bool:
        return any(e.has_step_in_flight() for e in self.replicas)

    def set_device_step(self, fn=None) -> None:
        """``Engine.set_device_step`` on every replica."""
        for e in self.replicas:
            e.set_device_step(fn)

    def generate(self, prompts, params=None, *, progress: bool = False) -> list:
        """``Engine.generate`` over the replicas (all prompts checked before any is routed)."""
        return generate(self, self, prompts, params, progress=progress)

    # --- the step -----------------------------------------------------------------------
    def step(self):
        """One step of every replica: all dispatch, then all read back. Outputs are grouped by
        replica (replica order), each group ordered as ``Engine.step`` orders it."""
        pending = [e.dispatch_step() for e in self.replicas]
        outputs = []
        for e, p in zip(self.replicas, pending):
            outputs += e.finish_step(p)
        for out in outputs:
            if out.finished:
                self._requests.pop(out.request_id, None)
        if self.handover is not None:
            for request_id, j in self.handover.run():
                self._requests[request_id] = j
        if self.step_record is not None:  # each replica recorded its dispatch above
            recs = [e.step_record[-1] for e in self.replicas]
            self.step_record.append({"ended": [r for d in recs for r in d["ended"]],
                                     "batch": [d["batch"] for d in recs],
                                     "preempted": [d["preempted"] for d in recs]})
        self.num_steps += any(p.launched is not None for p in pending)
        timing = StepTiming()
        for e in self.replicas:
            t = e.last_timing
            for f in ("schedule", "prepare", "device", "postprocess", "num_seqs", "num_tokens"):
                setattr(timing, f, getattr(timing, f) + getattr(t, f))
        self.last_timing = timing
        return outputs

    def record_steps(self) -> list[dict]:
        """``Engine.record_steps`` over the replicas: per ``step()`` one dict with ``ended``
        (every replica's, replica order), ``batch`` and ``preempted`` (one list per replica, as
        that replica recorded its dispatch). Where each request went is ``routed``."""
        for e in self.replicas:
            e.record_steps()
        self.step_record = []
        return self.step_record

    def reset_prefix_cache(self) -> bool:
        """``Engine.reset_prefix_cache`` on every replica, all or none: False (nothing changed)
        if any replica would refuse. The router keeps its state (a study that wants a new one
        assigns ``router``)."""
        if self.has_unfinished_requests() or any(
                e.block_manager.num_host_tier_blocks for e in self.replicas):
            return False
        return all([e.reset_prefix_cache() for e in self.replicas])

    def warmup(self, **kwargs) -> int:
        """``Engine.warmup`` on every replica (each compiles for its own devices), and with
        prefill replicas the hand-over's transfers (``HandOver.warmup``); returns the number of
        step shapes."""
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() must run before requests are added")
        shapes = max(e.warmup(**kwargs) for e in self.replicas)
        if self.handover is not None:  # and the hand-over's gather / scatter page buckets
            self.handover.warmup()
        return shapes

    # --- introspection ------------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        return self._trace_count() - self._traces_at_start

    def spec_decode_stats(self) -> dict:
        total = SpecStats()
        for e in self.replicas:
            if e.speculator is not None:
                for f in dataclasses.fields(SpecStats):
                    setattr(total, f.name, getattr(total, f.name) + getattr(e.speculator.stats, f.name))
        return total.as_dict()

    def kv_stats(self) -> dict:
        """The replicas' ``kv_stats()`` added up, and ``replicas``: each replica's own (with its
        ``num_running``, ``num_waiting``, ``num_requests_served``, its ``role`` ("prefill",
        "decode" or "both"), ``num_prefill_tokens`` / ``num_decode_tokens`` (tokens it computed
        in prompt chunks and in decode steps), ``kv_transfer_bytes`` (M_KV of the tokens sent by
        a prefill replica or received by a decode replica), ``kv_transfer_wire_bytes`` (whole,
        padded pages moved), ``num_handovers`` and ``num_parked``). Geometry (block size,
        dtype, layout) is the replicas' common value; ``position_utilization`` is the average
        weighted by in-use blocks; ``max_blocks_per_sequence`` the largest replica's."""
        per = []
        for i, e in enumerate(self.replicas):
            ho = self.handover
            d = e.kv_stats(held_for_transfer=() if ho is None else ho.held_seq_ids(i))
            d["role"] = self.roles[i]
            d.update(ho.replica_stats(i) if ho is not None else {
                "kv_transfer_bytes": 0, "kv_transfer_wire_bytes": 0, "num_handovers": 0,
                "num_parked": 0})
            per.append(d)
        merged = _merge(per)
        for key in _OWN:
            merged.pop(key)
        merged["prefill_replicas"] = self.config.prefill_replicas
        for r in merged.get("residency", {}).values():  # a rate is not a sum
            r["hit_rate"] = r["hit_tokens"] / r["query_tokens"] if r["query_tokens"] else 0.0
        if self.handover is not None:  # each hand-over is on two replicas: count it once
            records = self.handover.records
            merged["num_handovers"] = len(records)
            merged["kv_transfer_bytes"] = sum(r.bytes for r in records)
            merged["kv_transfer_wire_bytes"] = sum(r.wire_bytes for r in records)
        used = [d["num_used_blocks"] for d in per]
        utils = [d["ledger"]["position_utilization"] for d in per]
        merged["ledger"]["position_utilization"] = (
            None if not sum(used) else
            sum(u * n for u, n in zip(utils, used) if u is not None) / sum(used))
        peak = max(d["max_blocks_per_sequence"] for d in per)  # a maximum, not a sum
        merged["max_blocks_per_sequence"] = merged["block_manager"]["max_blocks_per_sequence"] = peak
        merged["data_parallel_size"] = len(self.replicas)
        merged["replicas"] = per
        return merged


def _router_view(replica):
    """What the router reads of a replica: an in-process ``Engine`` through ``EngineReplica``; a
    replica that answers the router itself (``paged.server.replica_process``) as it is."""
    return replica if hasattr(replica, "cached_prefix_tokens") else EngineReplica(replica)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _merge(dicts: list[dict]) -> dict:
    """Numeric leaves summed (a None, a replica with no value yet, skipped); dicts merged
    recursively; other values kept from the first."""
    out = {}
    for key, first in dicts[0].items():
        values = [d[key] for d in dicts]
        if isinstance(first, dict):
            out[key] = _merge(values)
        elif (key not in _SAME and any(_number(v) for v in values)
              and all(v is None or _number(v) for v in values)):
            out[key] = sum(v for v in values if v is not None)
        else:
            out[key] = first
    return out


__all__ = ["DataParallelEngine"]
