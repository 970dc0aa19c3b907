"""The host core of one engine replica: the request table, its collaborators and the host halves
of the step.

``HostCore`` builds and wires the host objects of a replica exactly once: the ``BlockManager``,
the ``InputBatch``, the ``BatchBuilder``, the ``Scheduler`` and the ``StepReader``; and it owns the
request table: which requests exist and their sequences (forked samples included), sequence ids,
deadlines, the aborts and timeouts still to report, and the count of requests served. Whatever
runs the device step composes one: ``paged.engine.engine.Engine`` (the jitted model step),
``paged.sim.replica.SimReplica`` (a step-time model and pseudo-tokens) and, through ``Engine``,
each data-parallel replica. A step is two calls (vLLM's ``schedule`` / ``update_from_output``):

    step = core.begin(now, driver)     # ended requests, schedule, begin step, build, commit;
                                       # the driver's hooks run the device side in between
    outputs = core.finish(step, tokens, now)   # step completed, read back, outputs

``begin`` calls ``driver.planned(step)`` after scheduling (speculation plans, a simulator prices
the step's shape), ``driver.compact(ops)`` before scheduling when a KV policy compacted
sequences (`paged.step.kv_policy_runner`), ``driver.prepare(sched)`` once the step has begun
(the device copies: swap, copy-on-write, host tier; draft proposals) and ``driver.launch(batch)`` between the build and the
commit (the device call, or a model of it); its result is ``step.out``. A step with nothing
scheduled has no batch: its copies still get a step of their own (``begin_copies`` /
``finish_copies``) and ``idle_step`` guards against a stall. The owner of the device step orders
the calls: an engine with async scheduling begins step k+1 before it finishes step k.
"""

from __future__ import annotations

import dataclasses
import time

from paged.config.engine_config import EngineConfig
from paged.kv.pools import build_host_pool
from paged.kv.spec import KVSpec
from paged.request.checks import derive_seed
from paged.request.outputs import RequestOutput, check_outputs, collect_outputs, state_of
from paged.request.sequence import SeqStatus, Sequence
from paged.step.batch import BatchBuilder, StepBatch
from paged.step.cascade_plan import CascadePlanner
from paged.step.input_batch import InputBatch
from paged.step.kv_policy_runner import KVPolicyRunner
from paged.step.readback import StepReader
from paged.step.scheduler import Scheduler, SchedulerOutput


@dataclasses.dataclass
class HostStep:
    """One step between ``HostCore.begin`` and ``HostCore.finish``.

    Attributes:
      now: when it began.
      ended: requests that timed out or were aborted before it (reported first), by id.
      sched: the scheduler's plan.
      batch: the built and committed batch (``None``: nothing was scheduled).
      out: what the driver's ``launch`` returned (the device's tokens, in flight).
      step_id: the block manager's step (``-1`` until begun).
    """

    now: float
    ended: list[str]
    sched: SchedulerOutput
    batch: StepBatch | None = None
    out: object = None
    step_id: int = -1

    def record(self, batch) -> dict:
        """The step as ``Engine.record_steps`` keeps it: ``ended``, ``batch`` (its composition
        in the input ``batch``) and ``preempted``."""
        return {"ended": list(self.ended), "batch": self.sched.composition(batch),
                "preempted": [[s.request_id, s.sample_index] for s in self.sched.preempted]}


class HostCore:
    """One replica's host state and the request table (module docstring).

    Args:
      config: the engine settings (pool geometry: ``config.pool_geometry()``; batching,
        scheduling, prefix caching, swap slots, debug checks).
      tokenizer: with ``eos_id`` (and ``eos_ids``), ``decode``, ``encode``.
      vocab_size: the model's vocabulary (prompt token ids are checked against it).
      kv_spec: the replica's KV spec (`paged.kv.spec.KVSpec`): its KV-cache groups and their
        windows (a grouped model's pool holds the same bytes as ``config.pool_geometry()``'s
        blocks in ``G`` times as many pages of ``L / G`` layers each, plus the null page), the
        prefix-cache salt and the host-tier slots.
      on_free: called with the block ids the pool frees (debug poisoning), or ``None``.

    Attributes:
      page_size, num_pages: the KV pool's geometry (page 0 is the null page).
      host_blocks: host swap slots (``preemption_mode="swap"``; else 0).
      block_manager, batch, builder, scheduler, reader: the collaborators, built here.
      num_requests_served: finished requests reported (any finish reason).
      num_steps: steps that ran a batch (begun by ``begin``, or fast-forwarded).
      num_prefill_tokens, num_decode_tokens, num_recompute_tokens: tokens scheduled in prompt
        chunks of never-preempted sequences, in decode (and verify) rows, and in chunks that
        recompute a preempted sequence's KV (``count_tokens``): the one definition the engine's
        ``kv_stats`` and the simulator's ``stats`` report.
    """

    def __init__(self, config: EngineConfig, *, tokenizer, vocab_size: int, kv_spec: KVSpec,
                 on_free=None):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.kv_spec = kv_spec
        pool = build_host_pool(config, kv_spec, on_free=on_free)
        self.block_manager = pool.block_manager
        self.page_size = page_size = pool.page_size
        self.num_pages = pool.num_pages
        self.pages_per_seq, self.host_blocks = pool.pages_per_seq, pool.host_blocks
        self.batch = InputBatch(config.max_model_len, self.pages_per_seq, tokenizer.eos_id)
        self.builder = BatchBuilder(self.batch, self.block_manager, page_size,
                                    min_tokens=config.min_token_bucket,
                                    min_seqs=config.min_seq_bucket, debug=config.debug_checks,
                                    cascade=CascadePlanner(config.cascade_attention, page_size))
        self.scheduler = Scheduler(config, self.block_manager, self.batch)
        self.reader = StepReader(self.batch, self.block_manager, self.scheduler,
                                 tokenizer=tokenizer, max_model_len=config.max_model_len,
                                 new_seq_id=self.new_seq_id, add_sample=self.add_sample)
        self.kv_runner = KVPolicyRunner.build(config.kv_policy, self)  # None: no KV policy
        self._requests: dict[str, list[Sequence]] = {}  # unfinished or finished-unreported
        self._num_deadlines = 0  # unfinished requests with a timeout (skip the scan when 0)
        self._aborted: set[str] = set()  # aborted since the last step, to report
        self._next_seq_id = 0
        self._num_requests = 0
        self._steps_without_progress = 0
        self.num_requests_served = 0
        self.num_steps = 0
        self.num_prefill_tokens = self.num_decode_tokens = self.num_recompute_tokens = 0
        self._feed_eviction = self.block_manager.eviction_feed  # None, or (now, waiting queue)

    # --- what request checks and routers read ------------------------------------------
    cache_salt = property(lambda self: self.block_manager.cache_salt, doc="The salt of every "
                          "prefix-cache key (model, weights, dtype); tenants' salts extend it.")
    num_requests = property(lambda self: self._num_requests, doc="Requests ever added (the index "
                            "of the next one: unseeded requests' seeds derive from it).")

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is unfinished, or finished and not reported yet."""
        return request_id in self._requests

    def unfinished_request_ids(self) -> list[str]:
        """Requests added and not yet reported finished (aborted ones excluded)."""
        return [r for r in self._requests if r not in self._aborted]

    def has_unfinished(self) -> bool:
        """Whether a step has work: a sequence waiting, running or swapped, or an abort to
        report. (A dispatched step not read back yet is the device step owner's to add.)"""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    has_unreported_aborts = property(lambda self: bool(self._aborted))

    num_waiting = property(lambda self: len(self.scheduler.waiting) + len(self.scheduler.swapped),
                           doc="Sequences not admitted now: waiting, or swapped out.")
    num_running = property(lambda self: len(self.scheduler.running) + len(self.scheduler.loading),
                           doc="Sequences admitted: running, or loading from the host tier.")

    def load(self) -> int:
        """The replica's load, which every router and placement reads: its unfinished sequences
        in the scheduler, ``num_waiting + num_running`` (waiting, swapped, loading, running).
        A loading sequence counts: it holds blocks and runs within a step or two, so a replica
        with many loads in flight is busy even before they run. Parked sequences (a hand-over
        out) do not: they have left the scheduler."""
        return self.num_waiting + self.num_running

    # --- requests -----------------------------------------------------------------------
    def add(self, request_id: str, token_ids: list[int], params, arrival_time: float | None,
            timeout_s: float | None, cache_salt: bytes | None, *, seed: int | None = None) -> None:
        """Adds a request that ``request_checks.check_request`` accepted (cannot fail).

        Args:
          seed: the seed of an unseeded request (default: derived from the engine's seed and
            this core's request count; a data-parallel engine passes its engine-wide one).
        """
        now = time.perf_counter() if arrival_time is None else arrival_time
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = derive_seed(self.config.seed, self._num_requests)
        seq_id = self.new_seq_id()
        if params.prompt_logprobs is not None:  # a prefix-cache hit would skip scored positions
            salt = self.cache_salt if cache_salt is None else cache_salt
            cache_salt = salt + f"|prompt-logprobs:{seq_id}".encode()
        seq = Sequence(seq_id, request_id, token_ids, len(token_ids), params, seed, now,
                       deadline=None if timeout_s is None else now + timeout_s,
                       cache_salt=cache_salt)
        self._num_requests += 1
        self._num_deadlines += seq.deadline is not None
        self._requests[request_id] = [seq]
        self.scheduler.add(seq)

    def abort(self, request_id: str, now: float) -> bool:
        """Finishes a request at ``now`` and releases its blocks (quarantined if a step may read
        them); its final output comes with the next step. False for unknown or finished."""
        seqs = self._requests.get(request_id)
        if not seqs or all(s.finished for s in seqs):
            return False
        self._finish_request(request_id, "abort", now)
        self._aborted.add(request_id)
        return True

    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def add_sample(self, child: Sequence) -> None:
        """A parallel sample forked from its request's first sequence joins the table and runs
        (``StepReader``)."""
        self._requests[child.request_id].append(child)
        self.scheduler.add_running(child)

    # --- receiving a hand-over (paged.fleet.handover: reserve, start, or abandon) ------------
    def reserve_received(self, token_ids, cache_salt, num_seqs: int) -> tuple[int, list] | None:
        """Blocks for a prompt whose KV another replica computed (``token_ids``: its computed
        slots), all or nothing, under a new sequence id; ``num_seqs`` ids in all (parallel
        samples fork at ``start_received``). Returns (prefix-cache hit tokens, the new ids), or
        None (nothing changed) if the pool cannot hold them now."""
        bm = self.block_manager
        if not bm.can_allocate(token_ids, cache_salt=cache_salt):
            return None
        ids = [self.new_seq_id() for _ in range(num_seqs)]
        hit = bm.allocate(ids[0], token_ids, cache_salt=cache_salt)
        if hit is None:
            return None
        return hit, ids

    def release_received(self, seq_ids) -> None:
        """Frees the blocks ``reserve_received`` took (the hand-over was abandoned)."""
        for seq_id in seq_ids:
            if self.block_manager.has_seq(seq_id):
                self.block_manager.free(seq_id)

    def start_received(self, request_id: str, seqs: list[Sequence]) -> None:
        """The reserved prompt's KV is here (or ordered before any read of it): its blocks count
        as computed (and get their prefix-cache keys), the parallel samples fork from them, and
        the request joins this table, its unfinished sequences running."""
        head, *samples = [s for s in seqs if s.status is SeqStatus.TRANSFER]
        bm = self.block_manager
        bm.mark_computed(head.seq_id, head.num_computed_tokens)
        for s in samples:  # parallel samples share the received prompt blocks
            bm.fork(head.seq_id, s.seq_id)
        self._requests[request_id] = seqs
        self._num_deadlines += seqs[0].deadline is not None
        for seq in seqs:
            seq.out_state = None
            if not seq.finished:
                self.scheduler.add_running(seq)

    def _finish_request(self, request_id: str, reason: str, now: float) -> None:
        for seq in self._requests[request_id]:
            if not seq.finished:
                self.scheduler.finish(seq, reason, now)

    # --- hand-over between replicas (paged.fleet.handover) -----------------------------------
    def park_prefilled(self) -> list[str]:
        """Requests whose prompt is computed and first token known leave the scheduler (a
        prefill replica's step end): their running sequences get status ``TRANSFER`` and keep
        their blocks; the requests stay in this table (abort and timeout work as before) until
        ``release_request``. Returns their ids in admission order."""
        ready = dict.fromkeys(s.request_id for s in self.scheduler.running
                              if s.num_output_tokens > 0 and not s.pending)
        for request_id in ready:
            for seq in self._requests[request_id]:
                if seq.status is SeqStatus.RUNNING:
                    self.scheduler.detach(seq)
        return list(ready)

    def transfer_seqs(self, request_id: str) -> list[Sequence]:
        """The unfinished (``TRANSFER``) sequences of a parked request; empty once it ended."""
        return [s for s in self._requests.get(request_id, ()) if s.status is SeqStatus.TRANSFER]

    def parked_seq_ids(self) -> list[int]:
        """Sequence ids of every parked (``TRANSFER``) sequence: blocks held for a hand-over."""
        return [s.seq_id for seqs in self._requests.values() for s in seqs
                if s.status is SeqStatus.TRANSFER]

    def release_request(self, request_id: str) -> list[Sequence]:
        """A parked request leaves this table for another replica's; its sequences are returned
        (their blocks here are the caller's to free). Not counted as served."""
        seqs = self._requests.pop(request_id)
        self._num_deadlines -= seqs[0].deadline is not None
        return seqs

    # --- the host halves of a step ------------------------------------------------------
    def begin(self, now: float, driver, *, build=None) -> HostStep:
        """Begins the step at ``now`` (module docstring): the requests that ended, the
        scheduler's plan, then, if it scheduled anything, the block manager's step, the batch
        (``build(sched)`` if given: a simulator's light batch; else ``BatchBuilder.build``), the
        driver's ``launch`` and the commit (rows advanced as if the step had run)."""
        self.block_manager.set_time(now)  # the residency figures' clock
        ended = self.take_ended(now)
        if self.kv_runner is not None and (ops := self.kv_runner.plan()):
            driver.compact(ops)  # before scheduling: the pages freed serve this step
        step = HostStep(now, ended, self.schedule(now))
        driver.planned(step)
        sched = step.sched
        if sched.is_empty:
            return step
        step.step_id = self.block_manager.begin_step()
        driver.prepare(sched)
        if build is None:
            batch = self.builder.build(sched.decode_rows, sched.scheduled, bool(sched.copies))
        else:
            batch = build(sched)
        batch.step_id = step.step_id
        step.batch = batch
        step.out = driver.launch(batch)
        self.builder.commit(sched.decode_rows, batch)
        self.num_steps += 1
        return step

    def read_back(self, step: HostStep, tokens, now: float, nxt: HostStep | None = None,
                  extras=None) -> tuple[list, dict]:
        """The step completed: its tokens (numpy, one per sample slot) and ``extras`` (log-probs,
        verify acceptances) are applied at ``now`` (``StepReader.read``); ``nxt``: the step begun
        since, if any. Returns ``(made, touched)`` for ``outputs``."""
        self.block_manager.step_completed(step.step_id)
        made, touched = self.reader.read(step.batch, tokens, now,
                                         None if nxt is None else nxt.batch, extras)
        if not self.reader.make_outputs:
            touched = self.finished_only(touched)
        if self.config.debug_checks:
            self.check_invariants()
        return made, touched

    def finish(self, step: HostStep, tokens, now: float, *, ended: list[str] | None = None,
               nxt: HostStep | None = None, extras=None) -> list[RequestOutput]:
        """Ends ``step`` (``read_back``) and returns the outputs: ``ended`` (default the step's
        own; an engine that overlaps steps reports the newer step's) first."""
        made, touched = self.read_back(step, tokens, now, nxt, extras)
        return self.outputs(step.ended if ended is None else ended, step.batch.decode, made,
                            touched)

    def begin_copies(self) -> int:
        """A step that scheduled nothing may still copy pages (swap, copy-on-write, host tier):
        the copies get a block-manager step of their own (its id)."""
        return self.block_manager.begin_step()

    def finish_copies(self, step_id: int) -> None:
        """The copies of ``begin_copies``' step are done."""
        self.block_manager.step_completed(step_id)

    def take_ended(self, now: float) -> list[str]:
        """The requests to report first in this step: those whose deadline passed at ``now``
        (finished here, ``"timeout"``) and those aborted since the last step; by id."""
        ended = self._expire(now) | self._aborted
        self._aborted = set()
        return sorted(ended)

    def take_aborted(self) -> list[str]:
        """The aborts not reported yet (by id), without expiring anything."""
        ended, self._aborted = sorted(self._aborted), set()
        return ended

    def _expire(self, now: float) -> set[str]:
        expired = set()
        if not self._num_deadlines:
            return expired
        for request_id, seqs in self._requests.items():
            if any(s.deadline is not None and now >= s.deadline and not s.finished for s in seqs):
                expired.add(request_id)
        for request_id in expired:
            self._finish_request(request_id, "timeout", now)
        return expired

    @property
    def has_deadlines(self) -> bool:
        """Whether an unfinished request has a timeout (a step may expire it)."""
        return bool(self._num_deadlines)

    def schedule(self, now: float) -> SchedulerOutput:
        """The scheduler's plan for the step starting at ``now``."""
        if self._feed_eviction is not None:
            self._feed_eviction(now, self.scheduler.waiting)
        sched = self.scheduler.schedule(now)
        if not sched.is_empty:
            self._steps_without_progress = 0
            self.count_tokens(sched)
        return sched

    def count_tokens(self, sched: SchedulerOutput) -> None:
        """Adds a plan's tokens to the prefill / decode / recompute counts (read before the
        step advances the rows). A single token after the prompt, or a verify row, is decode;
        a chunk of a sequence preempted before is recompute; any other chunk is prefill."""
        decode, prefill, recompute = len(sched.decode_rows), 0, 0
        for item in sched.scheduled:
            s, k = item.seq, item.num_new_tokens
            if item.num_draft or (k == 1 and s.num_computed_tokens >= s.num_prompt_tokens):
                decode += k
            elif s.num_preemptions:
                recompute += k
            else:
                prefill += k
        self.num_decode_tokens += decode
        self.num_prefill_tokens += prefill
        self.num_recompute_tokens += recompute

    def note_progress(self) -> None:
        """A step ran that the scheduler did not plan (a simulator's fast-forwarded steps)."""
        self._steps_without_progress = 0

    def count_fast_decode(self, num_rows: int, num_steps: int) -> None:
        """``num_steps`` pure decode steps of ``num_rows`` rows ran without ``begin`` (a
        simulator's fast-forward): counted as ``begin`` would count them."""
        self.num_steps += num_steps
        self.num_decode_tokens += num_rows * num_steps

    def idle_step(self, sched: SchedulerOutput) -> None:
        """A step that scheduled nothing: raises once too many in a row had unfinished work
        (the pool cannot hold what waits)."""
        if not self.scheduler.has_unfinished():
            return
        self._steps_without_progress += 1
        if self._steps_without_progress > self.config.max_steps_without_progress:
            raise RuntimeError(
                f"no sequence could be scheduled for {self._steps_without_progress} steps "
                f"(waiting={len(self.scheduler.waiting)}, swapped={len(self.scheduler.swapped)}, "
                f"free blocks={self.block_manager.num_allocatable_blocks}); the pool is too small")

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (``Engine.reset_prefix_cache``); False (nothing changed)
        while a request is unfinished or an abort unreported, or with a host tier."""
        bm = self.block_manager
        if self.has_unfinished() or bm.num_host_tier_blocks:
            return False
        bm.evict_cached()
        return True

    def check_invariants(self) -> None:
        """Debug: the block manager's invariants, and the input batch against it."""
        self.block_manager.check_invariants()
        self.batch.check(self.block_manager)
        if len(self.scheduler.running) != self.batch.num_rows:
            raise AssertionError(f"{len(self.scheduler.running)} running but "
                                 f"{self.batch.num_rows} input-batch rows")

    # --- outputs ------------------------------------------------------------------------
    def outputs(self, ended: list[str], decode: list[Sequence] = (), made: list = (),
                touched=()) -> list[RequestOutput]:
        """A step's outputs (``paged.request.outputs.collect_outputs``); finished requests are
        reported once and then forgotten."""
        if self.config.debug_checks:  # outputs made on the batched path equal the general ones
            check_outputs(made, self.request_output)
        return collect_outputs(ended, decode, made, touched, self._final_output, self._requests)

    def finished_only(self, request_ids) -> list[str]:
        """Of ``request_ids``, those known here whose every sample has finished."""
        reqs = self._requests
        return [r for r in request_ids if r in reqs and all(q.finished for q in reqs[r])]

    def _final_output(self, request_id: str) -> RequestOutput:
        """The request's output now; a finished request is forgotten (reported once)."""
        out = self.request_output(request_id)
        if out.finished:
            self.num_requests_served += 1
            seqs = self._requests.pop(request_id)
            self._num_deadlines -= seqs[0].deadline is not None
        return out

    def request_output(self, request_id: str) -> RequestOutput:
        """The request's output as of now (the table is unchanged)."""
        seqs = self._requests[request_id]  # sample order: forks are appended in index order
        head = seqs[0]
        # Samples not forked yet (prompt unfinished) are simply absent.
        finished = all(s.status is SeqStatus.FINISHED for s in seqs) and (
            len(seqs) == head.params.n or head.finish_reason in ("abort", "timeout")
            or head.num_output_tokens == 0)
        finish = max(s.finish_time for s in seqs) if finished else None
        return RequestOutput(head, head.num_known_tokens,
                             state_of(seqs, finished, finish, self.tokenizer.decode))


__all__ = ["HostCore", "HostStep"]
