"""Continuous-batching scheduler: who runs this step, with how many tokens, and who is preempted.

Plain Python over the block manager. Each ``schedule()`` reads top to bottom:

1. running sequences (decodes before partial prefills under "decode-first"), each given its next
   tokens; when the pool runs dry the newest not-yet-scheduled running sequence is preempted
   (recompute: free and go back to waiting; swap: pages to host), possibly the one being served.
   The steady state, every decoding sequence taking one token, is one batched block-manager call
   (``SchedulerOutput.decode``) rather than a call per sequence;
2. swapped sequences come back when nothing was preempted this step;
3. waiting requests are admitted (prefix-cache lookup, whole prompt allocated at once, all or
   nothing) while the sequence and token budgets last, chunking long prompts.

"prefill-first" admits waiting requests before serving running ones. "static" is request-level
batching: a batch is admitted only when nothing runs, and runs until every member finished.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from paged.block_manager import BlockManager
from paged.config import EngineConfig
from paged.sequence import SeqStatus, Sequence


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computed this step, starting at seq.num_computed_tokens


@dataclasses.dataclass
class SchedulerOutput:
    """What one step computes.

    ``decode`` holds the decoding sequences served by the batched fast path: each computes
    exactly one token (its last, at position ``num_computed_tokens``) and samples one.
    ``scheduled`` holds everything else (prefill chunks, decodes served one by one).
    """

    scheduled: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    decode: list[Sequence] = dataclasses.field(default_factory=list)
    decode_tokens: list[int] = dataclasses.field(default_factory=list)  # their input tokens
    decode_ids: list = dataclasses.field(default_factory=list)  # their seq_ids
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # CoW (src, dst) pages
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device page, host slot)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host slot, device page)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decode) + sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.decode


class Scheduler:
    """Waiting / running / swapped queues over one ``BlockManager``.

    ``on_release(seq)`` (optional) is called whenever a sequence stops running (finished,
    preempted or swapped out), so per-running-sequence state elsewhere can be dropped.
    ``sync()`` (optional) is called before the scheduler reads the token state of running
    sequences outside the steady batch the engine offered (``offer_steady``): the engine may keep
    that state in arrays while the batch repeats (``paged.decode_run``).
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 on_release: Callable[[Sequence], None] | None = None,
                 sync: Callable[[], None] | None = None):
        self.config = config
        self.bm = block_manager
        self.on_release = on_release
        self._sync = sync or (lambda: None)
        self.num_fast_decode_steps = 0  # steps whose decodes took the batched path
        self._version = 0  # bumped whenever ``running`` changes
        self._steady: tuple | None = None  # (version, decode, tokens, ids) offered by the engine
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.swapped: collections.deque[Sequence] = collections.deque()
        self.num_preemptions = 0
        self.num_swap_outs = 0

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
        self._version += 1

    def _unrun(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._version += 1

    def offer_steady(self, decode: list[Sequence], tokens: list[int], ids: list) -> None:
        """The engine, after a decode-only step: ``decode`` (the sequences that go on, each with
        its new token ``tokens[i]`` uncomputed) is next step's decode batch if ``running`` does
        not change before then, so the next ``schedule`` skips re-checking every sequence."""
        self._steady = (self._version, decode, tokens, ids)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def finish(self, seq: Sequence, reason: str, now: float) -> None:
        """Removes ``seq`` from its queue and releases its blocks (respecting quarantine)."""
        if seq.status is SeqStatus.RUNNING:
            self._unrun(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        if self.bm.has_seq(seq.seq_id):
            self.bm.free(seq.seq_id)
        seq.num_slots = 0
        if self.on_release is not None:
            self.on_release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now

    # --- the step -----------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        if self.config.scheduling == "static":
            if not self.running and not self.swapped:
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
        decode_first = self.config.policy == "decode-first"
        if decode_first and not out.scheduled and self._decode_fast(out, budget):
            if len(out.decode) == len(self.running):  # the steady state: nothing else runs
                return
            self._sync()
            scheduled_ids = {s.seq_id for s in out.decode}
        else:
            self._sync()
            scheduled_ids = {s.seq.seq_id for s in out.scheduled}
        order = [s for s in self.running if s.seq_id not in scheduled_ids]
        if decode_first:
            order.sort(key=lambda s: not s.is_decoding)  # stable: admission order within groups
        for seq in order:
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            if not budget.seqs or not budget.tokens:
                break
            n = min(seq.num_uncomputed, budget.tokens)
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
        """Serves every steady decoder (one token left, backed by no slot yet) in one batched
        ``append_decode_slots`` call, in admission order: exactly what the per-sequence loop does
        when the budgets and the pool cover them all. Returns False (nothing changed) otherwise."""
        steady, self._steady = self._steady, None
        if steady is not None and steady[0] == self._version and len(steady[1]) == len(self.running):
            decode, tokens, ids = steady[1:]  # exactly what the scan below would find
            if self.config.debug_checks:
                assert (decode, tokens) == self._steady_decoders(), "stale steady decode batch"
        else:
            self._sync()
            decode, tokens = self._steady_decoders()
            ids = [s.seq_id for s in decode]
        n = len(decode)
        if not n or n > budget.seqs or n > budget.tokens:
            return False
        copies = self.bm.append_decode_slots(ids, tokens)
        if copies is None:  # the pool runs dry: the per-sequence loop preempts
            return False
        for s in decode:
            s.num_slots += 1
        out.copies.extend(copies)
        out.decode, out.decode_tokens, out.decode_ids = decode, tokens, ids
        budget.tokens -= n
        budget.seqs -= n
        self.num_fast_decode_steps += 1
        return True

    def _steady_decoders(self) -> tuple[list[Sequence], list[int]]:
        """Running sequences with one token left that no slot backs yet, and those tokens."""
        decode, tokens = [], []
        for s in self.running:
            ids = s.token_ids
            c = s.num_computed_tokens
            if s.num_slots == c and len(ids) == c + 1 and c >= s.num_prompt_tokens:
                decode.append(s)
                tokens.append(ids[c])
        return decode, tokens

    def _swap_in(self, out: SchedulerOutput, budget: _Budget, now: float) -> None:
        while self.swapped and budget.seqs and budget.tokens:
            seq = self.swapped[0]
            if not self.bm.can_swap_in(seq.seq_id):
                break
            pairs = self.bm.swap_in(seq.seq_id)
            if pairs is None:
                break
            self.swapped.popleft()
            out.swap_in.extend(pairs)
            seq.status = SeqStatus.RUNNING
            self._run(seq)
            n = min(seq.num_uncomputed, budget.tokens)
            copies = self._grow(seq, n)
            if copies is None:
                break  # it stays running; the next step serves it
            out.copies.extend(copies)
            self._schedule(out, budget, seq, n, now)

    def _admit(self, out: SchedulerOutput, budget: _Budget, now: float, static: bool = False) -> None:
        # Static batching admits a whole batch (as many as fit, up to max_num_seqs) even when its
        # prompts exceed one step's token budget; members left without tokens are served later.
        while self.waiting and (
                len(self.running) < self.config.max_num_seqs if static else budget.seqs and budget.tokens):
            seq = self.waiting[0]
            # A request with n samples will hold n sequences once its prompt is done: count them
            # now, so resident sequences never exceed max_num_seqs.
            samples = seq.params.n if seq.sample_index == 0 and seq.num_output_tokens == 0 else 1
            if len(self.running) + samples > self.config.max_num_seqs:
                break
            if not self.bm.can_allocate(seq.token_ids):
                break
            num_cached = self.bm.allocate(seq.seq_id, seq.token_ids)
            if num_cached is None:
                break
            seq.num_slots = len(seq.token_ids)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            self._run(seq)
            n = min(seq.num_uncomputed, budget.tokens)
            if n and budget.seqs:
                self._schedule(out, budget, seq, n, now)

    # --- helpers ------------------------------------------------------------------------
    def _grow(self, seq: Sequence, n: int) -> list[tuple[int, int]] | None:
        """Slots for the next ``n`` tokens (only those not yet backed by blocks)."""
        new = seq.token_ids[seq.num_slots:seq.num_computed_tokens + n]
        if not new:
            return []
        copies = self.bm.append_slots(seq.seq_id, new)
        if copies is not None:
            seq.num_slots += len(new)
        return copies

    def _schedule(self, out, budget, seq, n, now) -> None:
        out.scheduled.append(ScheduledSeq(seq, n))
        budget.tokens -= n
        budget.seqs -= 1
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence | None:
        """The newest (latest arrival) running sequence not already scheduled this step."""
        candidates = [s for s in self.running if s.seq_id not in scheduled_ids]
        return max(candidates, key=lambda s: (s.arrival_time, s.seq_id), default=None)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._unrun(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.on_release is not None:
            self.on_release(seq)
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
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)


@dataclasses.dataclass
class _Budget:
    tokens: int
    seqs: int
