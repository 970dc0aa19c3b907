"""Continuous-batching scheduler: who runs this step, with how many tokens, and who is preempted.

Plain Python over the block manager. Each ``schedule()`` reads top to bottom:

1. running sequences (decodes before partial prefills under "decode-first"), each given its next
   tokens; when the pool runs dry the newest not-yet-scheduled running sequence is preempted
   (recompute: free and go back to waiting; swap: pages to host), possibly the one being served.
   The steady state, every decoding sequence taking one token, is found from the input batch's
   arrays and served by one batched block-manager call (``SchedulerOutput.decode_rows``) rather
   than a call per sequence;
2. swapped sequences come back when nothing was preempted this step;
3. waiting requests are admitted (prefix-cache lookup, whole prompt allocated at once, all or
   nothing) while the sequence and token budgets last, chunking long prompts. A request whose
   prefix hits the host tier waits in ``loading`` (not scheduled, counted against
   ``max_num_seqs``) until the step that copies its blocks to the device completes, and then
   runs; the tokens loaded per step are bounded by the token budget.

"prefill-first" admits waiting requests before serving running ones. "lpm" and "dfs-weight" run
as "decode-first" with the waiting queue reordered before admission by what the prefix cache
holds (``paged.step.waiting_order``, with its starvation guard). "static" is request-level
batching: a batch is admitted only when nothing runs, and runs until every member finished.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from paged.config.engine_config import EngineConfig
from paged.kv.block_manager import BlockManager
from paged.request.sequence import UNKNOWN, SeqStatus, Sequence
from paged.step.input_batch import InputBatch
from paged.step.waiting_order import ORDERS, WaitingOrder


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computed this step, starting at seq.num_computed_tokens
    num_draft: int = 0  # of those, proposed tokens to verify (speculative decoding)


@dataclasses.dataclass
class SchedulerOutput:
    """What one step computes.

    ``decode_rows`` are the input-batch rows of the decoding sequences served by the batched fast
    path: each computes exactly one token (its last, at position ``num_computed_tokens``) and
    samples one. ``scheduled`` holds everything else (prefill chunks, decodes served one by one).
    """

    scheduled: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    decode_rows: np.ndarray = dataclasses.field(default_factory=lambda: _NO_ROWS)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # CoW (src, dst) pages
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device page, host slot)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host slot, device page)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decode_rows) + sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not len(self.decode_rows)

    def composition(self, batch: InputBatch) -> list[list]:
        """The step's batch as ``[request_id, sample_index, num_new_tokens]`` triples: the batched
        decode rows (``batch``'s rows, read before the step commits) then ``scheduled``, in
        order; what an exact replay compares step by step (``experiments.replay``)."""
        rows = [[batch.seqs[r].request_id, batch.seqs[r].sample_index, 1]
                for r in self.decode_rows.tolist()]
        return rows + [[s.seq.request_id, s.seq.sample_index, s.num_new_tokens]
                       for s in self.scheduled]


_NO_ROWS = np.zeros(0, np.intp)


class Scheduler:
    """Waiting / running / swapped queues over one ``BlockManager`` and one ``InputBatch``.

    Every running sequence has an input-batch row: ``_run`` adds it, ``_unrun`` removes it (the
    row's token state moves back into the sequence). A sequence whose newest token is not known
    yet (sampled by the step in flight) and that must wait for it (``Sequence.pending``: its
    samples are forked from it, it surely finishes with it, or it left the batch meanwhile) is
    not scheduled, admitted, swapped in or chosen as a victim until the token is known.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, batch: InputBatch):
        self.config = config
        self.bm = block_manager
        self.batch = batch
        self.num_fast_decode_steps = 0  # steps whose decodes took the batched path
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.swapped: collections.deque[Sequence] = collections.deque()
        self.loading: list[Sequence] = []  # admitted, waiting for host-tier loads (by admission)
        self._load_start: dict[int, float] = {}  # seq id -> when its loading began
        self.load_wait_s = 0.0  # seconds sequences spent loading, summed
        self.num_loads = 0  # admissions that loaded from the host tier
        self.num_preemptions = 0
        self.num_swap_outs = 0
        # The cache-aware order of the waiting queue ("lpm", "dfs-weight"), else None (FCFS).
        self.order = (WaitingOrder(config.policy, block_manager, config.block_size,
                                   config.policy_max_wait_s)
                      if config.policy in ORDERS else None)

    # --- queues -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins the running queue (its blocks are already shared)."""
        seq.status = SeqStatus.RUNNING
        self._run(seq)

    def _run(self, seq: Sequence) -> None:
        self.running.append(seq)
        self.batch.add(seq)

    def _unrun(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.batch.remove(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.loading)

    def detach(self, seq: Sequence) -> None:
        """A running sequence leaves the queues for a hand-over to another replica
        (``paged.fleet.handover``): no row, never scheduled or preempted here again; its blocks stay
        held until the hand-over frees them (``finish`` frees them on abort or timeout)."""
        self._unrun(seq)
        seq.status = SeqStatus.TRANSFER

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self.loading)

    def finish(self, seq: Sequence, reason: str, now: float) -> None:
        """Removes ``seq`` from its queue and releases its blocks (respecting quarantine)."""
        if seq.status is SeqStatus.RUNNING:
            self._unrun(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        elif seq.status is SeqStatus.LOADING:
            self.loading.remove(seq)
            self._load_start.pop(seq.seq_id, None)
        seq.drop_unknown()
        if self.bm.has_seq(seq.seq_id):
            priority = seq.params.cache_priority
            if priority is not None and not self.bm.is_swapped(seq.seq_id):
                retention = seq.params.cache_retention_s
                self.bm.set_retention(seq.seq_id, priority,
                                      None if retention is None else now + retention)
            self.bm.free(seq.seq_id)
        seq.num_slots = 0
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now

    # --- the step -----------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs,
                         self.config.max_num_batched_tokens)
        if self.loading:
            self._finish_loads(now)
        if self.order is not None and self.waiting:
            self.order.apply(self.waiting, now)
        if self.config.scheduling == "static":
            if not self.running and not self.swapped and not self.loading:
                self._admit(out, budget, now, static=True)
            self._serve_running(out, budget, now)
        elif self.config.policy == "prefill-first":
            if not self.swapped:
                self._admit(out, budget, now)
            self._serve_running(out, budget, now)
            if not out.preempted:
                self._swap_in(out, budget, now)
        else:  # decode-first
            self._serve_running(out, budget, now)
            if not out.preempted:
                self._swap_in(out, budget, now)
            if not out.preempted and not self.swapped:
                self._admit(out, budget, now)
        return out

    def _serve_running(self, out: SchedulerOutput, budget: _Budget, now: float) -> None:
        decode_first = self.config.policy != "prefill-first"
        ib = self.batch
        served = np.zeros(ib.num_rows, bool)
        if decode_first and not out.scheduled and self._decode_fast(out, budget):
            if len(out.decode_rows) == len(self.running):  # the steady state: nothing else runs
                return
            served[out.decode_rows] = True
        else:
            for item in out.scheduled:
                served[item.seq.row] = True
        served |= ib.hold[:ib.num_rows]  # waits for the step in flight
        order = [s for s in self.running if not served[s.row]]
        if decode_first:
            order.sort(key=lambda s: not s.is_decoding)  # stable: admission order within groups
        scheduled_ids = {s.seq.seq_id for s in out.scheduled}
        scheduled_ids.update(ib.ids[r] for r in out.decode_rows.tolist())
        for seq in order:
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            if not budget.seqs or not budget.tokens:
                break
            n = self._chunk(seq, budget.tokens)
            while True:
                copies = self._grow(seq, n)
                if copies is not None:
                    out.copies.extend(copies)
                    self._schedule(out, budget, seq, n, now)
                    scheduled_ids.add(seq.seq_id)
                    break
                victim = self._pick_victim(scheduled_ids)
                if victim is None or victim is seq:
                    self._preempt(seq, out)
                    break
                self._preempt(victim, out)

    def _decode_fast(self, out: SchedulerOutput, budget: _Budget) -> bool:
        """Serves every steady decoder (one token left, backed by no slot yet, not held) in one
        batched ``append_decode_slots`` call: exactly what the per-sequence loop does when the
        budgets and the pool cover them all. Returns False (nothing changed) otherwise."""
        ib = self.batch
        rows = ib.decoders()
        n = len(rows)
        if not n or n > budget.seqs or n > budget.tokens:
            return False
        ids = ib.ids if n == ib.num_rows else [ib.ids[r] for r in rows.tolist()]
        toks = ib.tokens[rows, ib.num_computed[rows]]  # the rows pass through as arrays
        unknown = toks == UNKNOWN  # sampled by the step in flight: not known yet
        copies = self.bm.append_decode_slots(ids, toks, unknown if unknown.any() else None)
        if copies is None:  # the pool runs dry: the per-sequence loop preempts
            return False
        ib.num_slots[rows] += 1
        out.copies.extend(copies)
        out.decode_rows = rows
        budget.tokens -= n
        budget.seqs -= n
        self.num_fast_decode_steps += 1
        return True

    def _swap_in(self, out: SchedulerOutput, budget: _Budget, now: float) -> None:
        while self.swapped and budget.seqs and budget.tokens:
            seq = self.swapped[0]
            if seq.pending or not self.bm.can_swap_in(seq.seq_id):
                break
            pairs = self.bm.swap_in(seq.seq_id)
            if pairs is None:
                break
            self.swapped.popleft()
            out.swap_in.extend(pairs)
            seq.status = SeqStatus.RUNNING
            self._run(seq)
            n = self._chunk(seq, budget.tokens)
            copies = self._grow(seq, n)
            if copies is None:
                break  # it stays running; the next step serves it
            out.copies.extend(copies)
            self._schedule(out, budget, seq, n, now)

    def _admit(self, out: SchedulerOutput, budget: _Budget, now: float, static: bool = False) -> None:
        # Static batching admits a whole batch (as many as fit, up to max_num_seqs) even when its
        # prompts exceed one step's token budget; members left without tokens are served later.
        forks = None  # samples that running requests will still fork (counted when needed)
        while self.waiting and budget.loads > 0 and (
                len(self.running) + len(self.loading) < self.config.max_num_seqs if static
                else budget.seqs and budget.tokens):
            seq = self.waiting[0]
            if seq.pending:  # its newest token is not known yet
                break
            # A request with n samples will hold n sequences once its prompt is done: count them
            # now, so resident sequences never exceed max_num_seqs; and count the samples that
            # running requests will still fork (prompt unfinished, or its first token, from which
            # they fork, not read back yet).
            samples = seq.params.n if seq.sample_index == 0 and seq.num_output_tokens == 0 else 1
            if forks is None:
                forks = sum(s.params.n - 1 for s in (*self.running, *self.loading)
                            if s.params.n > 1 and s.sample_index == 0
                            and (s.num_output_tokens == 0 or s.num_output_tokens == 1 and s.pending))
            if len(self.running) + len(self.loading) + forks + samples > self.config.max_num_seqs:
                break
            if not self.bm.can_allocate(seq.token_ids, cache_salt=seq.cache_salt):
                break
            num_cached = self.bm.allocate(seq.seq_id, seq.token_ids, cache_salt=seq.cache_salt)
            if num_cached is None:
                break
            seq.num_slots = len(seq.token_ids)
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if self.order is not None:
                self.order.note_admitted(seq, now)
            loaded = self.bm.loading_tokens(seq.seq_id)  # host-tier hits, copied by this step
            if seq.num_preemptions == 0:  # the first admission; a re-admission keeps its count
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
                seq.num_host_cached_tokens = min(loaded, seq.num_cached_tokens)
                seq.out_state = None  # its outputs' recorded counters changed
            forks += samples - 1
            if loaded:
                seq.status = SeqStatus.LOADING
                self.loading.append(seq)
                self._load_start[seq.seq_id] = now
                self.num_loads += 1
                budget.loads -= loaded
                continue
            seq.status = SeqStatus.RUNNING
            self._run(seq)
            n = self._chunk(seq, budget.tokens)
            if n and budget.seqs:
                self._schedule(out, budget, seq, n, now)

    def _finish_loads(self, now: float) -> None:
        """Sequences whose host-tier load completed run from this step on (admission order)."""
        still = []
        for seq in self.loading:
            if self.bm.is_loading(seq.seq_id):
                still.append(seq)
                continue
            self.load_wait_s += now - self._load_start.pop(seq.seq_id)
            seq.status = SeqStatus.RUNNING
            self._run(seq)
        self.loading = still

    # --- helpers ------------------------------------------------------------------------
    def _grow(self, seq: Sequence, n: int) -> list[tuple[int, int]] | None:
        """Slots for the next ``n`` tokens (only those not yet backed by blocks)."""
        new = seq.tokens(seq.num_slots, seq.num_computed_tokens + n)
        if not new:
            return []
        copies = self.bm.append_slots(seq.seq_id, new)
        if copies is not None:
            seq.num_slots += len(new)
        return copies

    def _chunk(self, seq: Sequence, tokens: int) -> int:
        """Tokens to compute for ``seq`` now: at most ``tokens``; with a KV policy, a chunk ends
        where the policy runs next, so a recompute after preemption replays every call
        (docs/kv-policies.md)."""
        n = min(seq.num_uncomputed, tokens)
        if self.config.kv_policy is not None:
            c = seq.num_computed_tokens
            at = seq.kv_next if seq.kv_next >= 0 else seq.num_prompt_tokens
            if c < at < c + n:
                n = at - c
        return n

    def _schedule(self, out, budget, seq, n, now) -> None:
        out.scheduled.append(ScheduledSeq(seq, n))
        budget.tokens -= n
        budget.seqs -= 1
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence | None:
        """The newest (latest arrival) running sequence not already scheduled this step."""
        candidates = [s for s in self.running if s.seq_id not in scheduled_ids and not s.pending]
        return max(candidates, key=lambda s: (s.arrival_time, s.seq_id), default=None)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._unrun(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        seq.out_state = None  # its outputs' recorded counters changed
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap":
            pairs = self.bm.swap_out(seq.seq_id)
            if pairs is not None:
                out.swap_out.extend(pairs)
                seq.status = SeqStatus.SWAPPED
                self.swapped.append(seq)
                self.num_swap_outs += 1
                return
        # Recompute (or swap space exhausted): drop the KV; the prefix cache may bring it back.
        self.bm.free(seq.seq_id)
        seq.num_slots = 0
        seq.num_computed_tokens = 0
        seq.forget_kv_policy()
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)


@dataclasses.dataclass
class _Budget:
    tokens: int
    seqs: int
    loads: int  # host-tier tokens this step may still load
