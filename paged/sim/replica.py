"""One simulated engine replica: the real host code path with the device step replaced.

``SimReplica`` composes the same ``paged.step.host_core.HostCore`` as ``paged.engine.engine.Engine``: the real
``BlockManager``, ``InputBatch``, ``Scheduler``, ``BatchBuilder`` and ``StepReader``, and the
request table (requests, sequence ids, deadlines, aborts, outputs), through the core's public
methods only. What it replaces:

* the device call: no KV cache, no weights. A step's duration comes from a
  ``paged.sim.step_model.StepTimeModel`` given the step's ``StepShape``;
* the sampled tokens: deterministic pseudo-tokens, a hash of (the sequence's sampling seed, its
  sample index, the position), in ``[0, 256)`` (byte ids: never BOS or EOS). A request's tokens
  are the same whenever it is recomputed, and different requests' tokens differ, so prefix keys
  behave as they do with a model;
* the clock: the caller passes simulated time to ``begin`` and ``finish``.

Steps are serial, as ``EngineConfig(async_scheduling=False)``: ``begin(now)`` is
``HostCore.begin`` with this replica as the driver (the step's shape priced, its pseudo-tokens
drawn) and returns the step's duration; ``finish(now + duration)`` is ``HostCore.finish``, which
stamps the step's tokens with the finish time. The counters (steps, prefill / decode / recompute
tokens) are the core's, as the engine's ``kv_stats`` reports them. Overlap is not
modelled. Only requests that finished get outputs (``StepReader.make_outputs = False``): the
simulator keeps those and nothing else.

``build_device=True`` builds the real padded ``DeviceBatch`` with ``BatchBuilder.build`` each step
(the serving code path, numpy only); ``False`` builds only what ``commit`` and ``StepReader.read``
use (``light_batch``: same decodes, positions, samples, items and stop candidates), which is
faster for large fleets. The tests check that both give the same schedule.

Fast-forward (``fast_forward=True``, with ``build_device=False`` and a stateless step model): when
a step would be a pure decode step of every running sequence (nothing waiting or swapped, no
abort or deadline pending, every row a steady decoder with n == 1 and no stop ids), the schedule
of the next steps is known up to the first one that samples a sequence's last token (included)
or until the pool could run short: ``plan(now)`` computes that stretch's step times (the model's
time of each step's ``StepShape``, the same float sums as stepping) without running it.
``advance_to(t)`` then applies the steps that ended by ``t`` in one
``BlockManager.run_decode_steps`` (the state their own block-manager calls leave; input-batch rows
written in bulk), runs the last step's readback if it ended (``StepReader``'s stops; outputs wait
in ``take_outputs``) and begins the step in flight at ``t`` on the ordinary path. The simulator
calls it at the stretch's end, when a request or an abort reaches the replica mid-stretch, before
a router reads the block manager (``prefix_aware``) and at the time limit; the state it leaves is
the state stepping leaves (tests compare records, schedules and counters). A stretch applied to
its end whose rows are not all gone goes on from there (``continue_at``, in the same event:
nothing waits, so the next steps are pure decode steps of the rows left).
"""

from __future__ import annotations

import collections
import dataclasses
from bisect import bisect_right

import numpy as np

from paged.config.engine_config import EngineConfig
from paged.config.support import check_supported
from paged.fleet.routing import cached_prefix_tokens
from paged.kv.spec import KVSpec
from paged.models.tokenizer import ByteTokenizer
from paged.request.checks import check_request
from paged.sim.batches import light_batch, pseudo_tokens, step_shape, step_tokens
from paged.sim.host_link import HostLink
from paged.sim.step_model import StepShape, StepTimeModel
from paged.sim.stretch import Stretch, apply_stretch, plan_stretch
from paged.sim.tier import SimTier
from paged.step.batch import StepBatch
from paged.step.host_core import HostCore
from paged.step.scheduler import SchedulerOutput

ROLES = ("both", "prefill", "decode")


class _Dims:
    """The model facts the host code reads (vocabulary size; a salt for prefix keys; full
    attention)."""

    sliding_window = None
    layer_windows = (None,)

    def __init__(self, vocab_size: int, salt: str):
        self.vocab_size = vocab_size
        self._salt = salt

    def to_dict(self) -> dict:
        return {"sim": self._salt, "vocab_size": self.vocab_size}


class SimReplica:
    """An engine replica whose device step is a step-time model (module docstring).

    Args:
      config: the engine settings (``async_scheduling`` is ignored: steps are serial).
      step_model: seconds per step from its shape.
      model_config: an object with ``vocab_size``, ``layer_windows`` and ``to_dict()`` (a
        ``LlamaConfig`` or a ``paged.sim.specs.ModelDims``); it enters the prefix-cache salt
        as in the engine, and a model whose every layer slides (``recycling_window``) has its
        blocks recycled behind the window by the real block manager, and its steps' shapes count
        only in-window KV (``step_shape``; fast-forward is off: ``run_decode_steps`` does not
        recycle). Default: the byte vocabulary, full attention.
      build_device: build the real padded device batch every step (see the module docstring).
      token_salt: mixed into the pseudo-tokens (a different "model").
      record_schedule: keep, per step, ``(start time, [(request id, tokens)], [preempted ids])``.
      name: for reports.
      fast_forward: allow ``plan`` / ``advance_to`` (module docstring); used only where exact.
      role: ``"both"`` (colocated), ``"prefill"`` or ``"decode"`` (a disaggregated fleet,
        ``paged.sim.disagg``); reported in ``stats``.
      host_link: the host-device link that prices the host KV tier's copies
        (``config.host_kv_cache_bytes > 0``; default ``paged.sim.host_link.PCIE5_X16``). The tier
        holds ``host_kv_cache_bytes // model_config.kv_bytes_per_block(block_size)`` blocks (so
        ``model_config`` must be a ``ModelDims``); its bookkeeping is the engine's
        (``paged.kv.blocks.host_tier``) and each step's loads and offloads are priced by
        ``paged.sim.host_link.TierPricer`` (loads before the step's compute, offloads beside it).

    With ``config.cascade_attention`` on or auto, a decode-only step's shape counts the shared
    prefix reads its groups save (``shape_of``; ``paged.step.cascade_plan``'s groups and cost rule);
    fast-forward is off then.
    """

    def __init__(self, config: EngineConfig, step_model: StepTimeModel, *, model_config=None,
                 build_device: bool = True, token_salt: int = 0, record_schedule: bool = False,
                 name: str = "replica", fast_forward: bool = True, role: str = "both",
                 host_link: HostLink | None = None):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if not isinstance(step_model, StepTimeModel):
            raise TypeError(f"step_model must be a StepTimeModel, got {type(step_model).__name__}")
        if role not in ROLES:
            raise ValueError(f"role={role!r} must be one of {ROLES}")
        self.config = config
        self.name = name
        self.role = role
        self.step_model = step_model
        self.tokenizer = ByteTokenizer()
        self.model_config = model_config or _Dims(self.tokenizer.vocab_size, "byte")
        # The engine's refusals (paged.config.support), then W when every layer slides (the
        # engine's rule: a window shorter than a block); the shape counts in-window reads under
        # any KV layout.
        check_supported(config, self.model_config, prefill_decode=role != "both")
        self.kv_spec = spec = KVSpec.build(self.model_config, config)
        if config.kv_policy is not None and spec.model is None:
            raise ValueError(f"kv_policy={config.kv_policy!r}: the simulator runs the policy's "
                             f"bookkeeping per layer; pass model_config with the model's "
                             f"dimensions (a ModelDims or LlamaConfig)")
        self.window = spec.window
        self._tier = SimTier.build(config, spec, host_link)
        self.core = core = HostCore(config, tokenizer=self.tokenizer,
                                    vocab_size=self.model_config.vocab_size, kv_spec=spec)
        self.page_size, self.num_pages = core.page_size, core.num_pages
        self.block_manager, self.batch, self.scheduler = (
            core.block_manager, core.batch, core.scheduler)
        self._builder, self._reader = core.builder, core.reader
        self._shape: StepShape | None = None  # the step being begun's (``planned``)
        self._compacted = 0  # blocks a KV policy's compactions rewrote before this step
        self.build_device = bool(build_device)
        self.token_salt = int(token_salt)
        self.schedule_log: list | None = [] if record_schedule else None
        self.busy_s = 0.0
        self._inflight = None
        self._idle = True  # no unfinished request after the last step (or none yet)
        self._reader.make_outputs = False  # the simulator keeps finished requests' outputs only
        self._stretch: Stretch | None = None
        self._pads: dict = {}  # row count -> a decode step's buckets (``plan_stretch``)
        self._ready: list = []  # outputs of requests a stretch finished, for ``take_outputs``
        self.version = 0  # bumped whenever a planned stretch is planned or cut
        self.num_fast_steps = 0  # steps applied by fast-forward
        self.kv_transfer_bytes = 0  # KV bytes handed over (sent by prefill, received by decode)
        self.fast_forward = bool(
            fast_forward and not self.build_device and not config.debug_checks
            and self.window is None and config.cascade_attention == "off"
            and config.kv_policy is None
            and getattr(step_model, "stateless", False) and config.policy != "prefill-first"
            and config.scheduling == "continuous"
            and all(not 0 <= e < 256 for e in self._reader.eos_ids))

    @property
    def cache_salt(self) -> bytes:
        """The model's prefix-cache salt (``request_checks`` prepends it to a tenant's)."""
        return self.core.cache_salt

    def unfinished_request_ids(self) -> list[str]:
        return self.core.unfinished_request_ids()

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: a sequence waiting, running or swapped (aborts still to
        report are ``has_unreported_aborts``)."""
        return self.scheduler.has_unfinished()

    @property
    def has_unreported_aborts(self) -> bool:
        return self.core.has_unreported_aborts

    # --- what a router reads -----------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    @property
    def num_running(self) -> int:
        """Running or loading (``HostCore.num_running``; ``load()`` is their sum with waiting)."""
        return self.core.num_running

    def load(self) -> int:
        return self.core.load()

    @property
    def num_steps(self) -> int:
        """Steps that ran a batch (fast-forwarded ones included: ``HostCore.num_steps``)."""
        return self.core.num_steps

    def cached_prefix_tokens(self, token_ids, cache_salt=None, probe=None) -> int:
        return cached_prefix_tokens(self.block_manager, token_ids, cache_salt, probe)

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, request_id, prompt, params, *, arrival_time: float,
                    timeout_s: float | None = None, cache_salt=None) -> None:
        """``Engine.add_request`` (same checks) at simulated ``arrival_time``."""
        self.core.add(*check_request(self.core, request_id, prompt, params, arrival_time,
                                     timeout_s, cache_salt))

    def abort(self, request_id: str, now: float) -> bool:
        """``Engine.abort`` at simulated time ``now`` (its output comes with the next step)."""
        return self.core.abort(request_id, now)

    def report_aborts(self) -> list:
        """The outputs of the aborts not reported yet (by id), now, without a step."""
        return self.core.outputs(self.core.take_aborted())

    # --- hand-overs (a disaggregated fleet, ``paged.sim.disagg``) ------------------------------
    # The protocol (``paged.fleet.handover.HandOver``) calls the host core's send and receive
    # methods (park_prefilled, transfer_seqs, release_request; reserve_received,
    # start_received, release_received) itself, as it does on an engine.
    def new_seq_id(self) -> int:
        return self.core.new_seq_id()

    def note_transfer(self, nbytes: int) -> None:
        """A hand-over this replica sent or received landed: ``nbytes`` of KV moved."""
        self.kv_transfer_bytes += nbytes

    def drop_step(self) -> None:
        """Forgets the step in flight (the simulation's time limit: it never ends)."""
        self._inflight = None

    @property
    def in_step(self) -> bool:
        return self._inflight is not None

    @property
    def in_stretch(self) -> bool:
        return self._stretch is not None

    # --- fast-forward ----------------------------------------------------------------------------
    def plan(self, now: float, max_steps: int = 128, *, steady: bool = False) -> float | None:
        """Plans a stretch of pure decode steps from ``now`` if the next steps surely are ones
        (module docstring); returns the stretch's end time, or ``None`` (step normally).
        ``steady``: the rows are those a stretch applied to its end left (``continue_at``)."""
        if not self.fast_forward or self._inflight is not None or self.core.has_unreported_aborts \
                or self.core.has_deadlines or self._stretch is not None:
            return None
        st = plan_stretch(self.batch, self.scheduler, self.block_manager, self.config,
                          self._builder, self.step_model, now=now, max_steps=max_steps,
                          page_size=self.page_size, after_idle=self._idle,
                          token_salt=self.token_salt, tier=self._tier is not None, steady=steady,
                          pads=self._pads)
        if st is None:
            return None
        self._stretch = st
        self.version += 1
        self.core.note_progress()
        return st.ends[-1]

    def continue_at(self, t: float) -> float | None:
        """The stretch that ended at ``t`` (``advance_to(t)`` applied all of it, the last
        step's readback included) goes on through its finishes: the next stretch from ``t`` is
        planned at once from the rows it left, without the per-row checks (``plan_stretch``'s
        ``steady``). Nothing waits (a request that reached the replica cut the stretch before
        this step), so that is what ``plan(t)`` plans; whatever reaches the replica at ``t``
        later in the loop's order (arrival, abort, policy) cuts it before its first step, which
        leaves the replica free at ``t`` as if it had not been planned. Returns the new
        stretch's end time, or ``None`` (the loop begins the replica as any free one)."""
        if self._inflight is not None or self._stretch is not None:
            raise RuntimeError(f"{self.name}: continue_at needs a stretch applied to its end")
        if not self.scheduler.has_unfinished():
            return None
        return self.plan(t, steady=True)

    def advance_to(self, t: float, *, begin_at_t: bool = False) -> float | None:
        """Ends the planned stretch at time ``t``: the steps that ended by ``t`` are applied; the
        one begun before ``t`` (or at ``t``, with ``begin_at_t``) begins on the ordinary path.

        Returns:
          That step's end time, or ``None`` (no step in flight: free at ``t``).
        """
        st = self._stretch
        if st is None:
            return None
        self._apply(st, min(bisect_right(st.ends, t), st.k))
        self._stretch = None
        self.version += 1
        if st.done == st.k:
            return None
        s = st.starts[st.done]
        if s < t or (begin_at_t and s == t):
            # Requests that came after the stretch was cut short (``truncate``) arrived after
            # this step began: it is scheduled without them.
            sched = self.scheduler
            late, sched.waiting = sched.waiting, collections.deque()
            try:
                dur, outs = self.begin(s)
            finally:
                sched.waiting = late
            if dur is None or outs:
                raise RuntimeError(f"{self.name}: the fast-forwarded step did not resume")
            return s + dur
        return None

    def prefix_query_unchanged(self, token_ids, t: float) -> bool:
        """Whether ``cached_prefix_tokens(token_ids)`` answers at ``t`` what it answers now,
        mid-stretch, without applying the stretch (``Stretch.prefix_unchanged``)."""
        st = self._stretch
        return st is None or st.prefix_unchanged(self.batch, token_ids, t)

    def truncate(self, t: float) -> float | None:
        """A request reaches the replica at ``t`` mid-stretch: the stretch stops after the step
        in flight at ``t`` (scheduled before the request came, so unchanged by it); nothing is
        applied yet. Adding a request touches neither the block manager nor the input batch.

        Returns:
          The stretch's new end, or ``None`` when no step is in flight at ``t`` (the steps that
          ended by ``t`` are applied; the replica is free).
        """
        st = self._stretch
        m = bisect_right(st.ends, t)
        if m < st.k and st.starts[m] < t:
            if m + 1 < st.k:
                st.k, st.finishes = m + 1, False
            self.version += 1
            return st.ends[m]
        return self.advance_to(t)

    def _apply(self, st: Stretch, upto: int) -> None:
        """Applies planned steps ``st.done .. upto - 1`` (``apply_stretch``); the outputs of the
        requests its last step finished wait in ``take_outputs``."""
        m = upto - st.done
        if m <= 0:
            return
        self.busy_s, last = apply_stretch(st, upto, self.batch, self.scheduler, self.block_manager,
                                          self._reader, busy_s=self.busy_s, name=self.name,
                                          log=self.schedule_log)
        self.core.count_fast_decode(st.n, m)
        self.num_fast_steps += m
        # As ``finish`` after each step: a step ran, so the next is not after a pause unless
        # it finished every request (a stretch planned after one prices only its first step so).
        self._idle = last is not None and not self.scheduler.has_unfinished()
        if last is not None:
            self._ready += self.core.outputs([], *last, ())

    def take_outputs(self) -> list:
        """The outputs of requests an applied stretch finished (``advance_to``), once."""
        out, self._ready = self._ready, []
        return out

    # --- the step ------------------------------------------------------------------------------
    def begin(self, now: float):
        """Begins one step at ``now`` (``HostCore.begin``, with this replica as the driver: the
        step's shape priced, its pseudo-tokens drawn).

        Returns:
          ``(duration_s, outputs)``: the step's duration (``None`` when nothing could be scheduled;
          then ``outputs`` holds the requests that ended and nothing is in flight).
        """
        if self._inflight is not None:
            raise RuntimeError(f"{self.name}: a step is in flight; finish it first")
        core = self.core
        step = core.begin(now, self, build=None if self.build_device else self._light)
        if step.batch is None:
            step.step_id = core.begin_copies()
            copy_s = self._tier_step(None)  # loads of sequences admitted into ``loading``
            core.idle_step(step.sched)
            if copy_s is not None:  # a copy-only step (as the engine's): nothing computes
                self.busy_s += copy_s
                self._inflight = step
                return copy_s, []
            core.finish_copies(step.step_id)
            return None, core.outputs(step.ended)
        duration = float(self.step_model.time(self._shape))
        if self._tier is not None:
            duration = self._tier_step(duration) or duration
        self.busy_s += duration
        self._inflight = step
        return duration, []

    # HostCore.begin's driver hooks (paged.step.host_core): the modelled device side.
    def planned(self, step) -> None:
        """After scheduling: the step's shape (read before the commit) and its log entry."""
        sched = step.sched
        if sched.is_empty:
            return
        self._shape = self.shape_of(sched)
        if self._compacted:  # a KV policy's compactions, priced as copies of their regions
            self._shape = dataclasses.replace(
                self._shape, copy_blocks=self._shape.copy_blocks + self._compacted)
            self._compacted = 0
        if self.schedule_log is not None:
            ib = self.batch
            ran = [(ib.seqs[r].request_id, 1) for r in sched.decode_rows.tolist()]
            ran += [(it.seq.request_id, it.num_new_tokens) for it in sched.scheduled]
            self.schedule_log.append((step.now, ran, [s.request_id for s in sched.preempted]))

    def compact(self, ops) -> None:
        """A KV policy's compactions (``HostCore.begin``, before scheduling; the host side, the
        blocks freed, is the engine's): the device half would read each op's region and write
        its survivors, priced as a copy of the region's blocks with the next step."""
        self._compacted += sum(len(op.plan.region) for op in ops)

    def prepare(self, sched) -> None:
        """Nothing to copy on a modelled device (host-tier copies are priced after the build)."""

    def launch(self, batch: StepBatch) -> np.ndarray:
        """The step's "sampled" tokens (read before the commit)."""
        return step_tokens(self.batch, batch, self.token_salt)

    def _light(self, sched) -> StepBatch:
        return light_batch(self.batch, sched)

    def finish(self, now: float) -> list:
        """Reads back the step in flight at ``now`` (its end); returns the outputs."""
        step, self._inflight = self._inflight, None
        if step.batch is None:  # a copy-only step
            self.core.finish_copies(step.step_id)
            return self.core.outputs(step.ended)
        outs = self.core.finish(step, step.out, now)
        self._idle = not self.scheduler.has_unfinished()
        return outs

    def _tier_step(self, compute_s: float | None) -> float | None:
        """The step just begun, its host-tier copies priced (``SimTier.step``); ``None``
        without a tier or copies."""
        return None if self._tier is None else self._tier.step(self.block_manager, compute_s)

    def shape_of(self, sched: SchedulerOutput) -> StepShape:
        """The scheduled step's shape (call before the step is committed); a decode-only step
        with cascade attention on carries the prefix reads its groups save (``kv_shared``)."""
        shape = step_shape(self.batch, self._builder, sched, after_idle=self._idle,
                           window=self.window)
        planner = self._builder.cascade
        if planner.mode == "off" or sched.scheduled or not len(sched.decode_rows):
            return shape
        ib, rows = self.batch, sched.decode_rows
        tables = [self.block_manager.block_table(ib.ids[r]) for r in rows.tolist()]
        pages = np.zeros((len(tables), max(map(len, tables))), np.int64)  # NULL_PAGE padded
        for i, t in enumerate(tables):
            pages[i, :len(t)] = t
        groups = planner.select(pages, ib.num_computed[rows] + 1, shape.padded_seqs)
        if not groups:
            return shape
        if not self.build_device:  # a light batch never asks the planner: count its choice
            planner.count(groups)
        saved = sum((len(m) - 1) * p for m, p in groups) * self.page_size
        return dataclasses.replace(shape, kv_shared=saved)

    # --- figures -------------------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager.stats()
        sched = self.scheduler
        cascade = self._builder.cascade.stats()
        return {"name": self.name, "role": self.role, "num_steps": self.num_steps,
                "busy_s": self.busy_s, "num_prefill_tokens": self.core.num_prefill_tokens,
                "num_decode_tokens": self.core.num_decode_tokens,
                "num_recompute_tokens": self.core.num_recompute_tokens,
                "kv_transfer_bytes": self.kv_transfer_bytes,
                "num_fast_forward_steps": self.num_fast_steps,
                "num_preemptions": sched.num_preemptions, "num_swap_outs": sched.num_swap_outs,
                "prefix_cache_hit_tokens": bm.get("hit_tokens", 0),
                "peak_used_blocks": bm["peak_used_blocks"], "num_blocks": self.num_pages,
                "block_size": self.page_size,
                "max_blocks_per_sequence": bm["max_blocks_per_sequence"],
                "recycled_blocks": bm["recycled_blocks"], "sliding_window": self.window,
                "cascade_steps": cascade["steps"],
                "cascade_prefix_tokens_shared": cascade["prefix_tokens_shared"],
                **({"host_tier": self.host_tier_stats()} if self._tier else {}),
                **({"kv_policy": self.core.kv_runner.stats()} if self.core.kv_runner else {})}

    def host_tier_stats(self) -> dict:
        """The host tier's counters and link seconds (``SimTier.stats``; empty without one)."""
        return {} if self._tier is None else self._tier.stats(self.block_manager, self.scheduler)


__all__ = ["SimReplica", "light_batch", "pseudo_tokens", "step_shape"]
