"""Reading a step's result back: fill in the sampled tokens, key computed blocks, stop, fork.

The step was dispatched with its rows advanced optimistically (``BatchBuilder.commit``): one
``UNKNOWN`` token per sampling row, computed counts moved on. When its sampled tokens reach the
host, ``StepReader.read`` fills those tokens in (array writes for the decodes), tells the block
manager which tokens the next step's fed slots hold and which blocks are now computed, checks stops
(only the decodes that may stop are looked at), forks parallel samples, and makes the outputs.

A sequence may have changed since the step was dispatched: finished (abort, timeout: its result is
dropped), preempted by the scheduling of the next step (its token still counts: it is written into
the sequence), or moved to another row (rows are condensed). Each is handled here.
"""

from __future__ import annotations

import numpy as np

from paged.request.outputs import RequestOutput, state_of
from paged.request.sequence import Sequence
from paged.request.stop_strings import stop_reason
from paged.step.batch import StepBatch
from paged.step.input_batch import STOPS_ON_EOS


class StepReader:
    """Applies step results to the sequences, the block manager and the scheduler.

    Args:
      batch, block_manager, scheduler: the replica's input batch, block manager and scheduler.
      tokenizer: with ``eos_id`` (and ``eos_ids``) and ``decode``.
      max_model_len: the longest sequence (a stop by length).
      new_seq_id: a fresh sequence id (a forked sample's).
      add_sample: a forked sample joins the request table and runs.

    Attributes:
      speculator: the replica's ``paged.engine.spec_decode.Speculator`` (verify rows are read back
        through it), or ``None``.
      make_outputs: ``False``: only finished requests get outputs (a simulator drops the
        others); the decodes' outputs are then made per request, for those that finished, and
        none for the rest.
    """

    def __init__(self, batch, block_manager, scheduler, *, tokenizer, max_model_len: int,
                 new_seq_id, add_sample):
        self.ib = batch
        self.bm = block_manager
        self.scheduler = scheduler
        self.page_size = block_manager.block_size
        eos = tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))
        self.eos_ids = tuple(t for t in eos if t >= 0)  # every token that ends generation
        self.max_model_len = max_model_len
        self.text = tokenizer.decode
        self.new_seq_id, self.add_sample = new_seq_id, add_sample
        self.speculator = None
        self.make_outputs = True
        self.kv_offsets = False  # a KV policy compacts rows: slot = position - dropped

    def read(self, batch: StepBatch, tokens: np.ndarray, now: float, nxt: StepBatch | None,
             extras: tuple | None = None) -> tuple[list[RequestOutput | None | bool], dict[str, None]]:
        """Applies ``tokens`` (the step's samples) to ``batch``'s sequences; ``nxt`` is the step
        dispatched since (its fed slots learn their tokens here), if any; ``extras``: the step's
        log-probabilities (``device_step``), if it computed them.

        Returns:
          per decode, its request's output if made here (``None``: made later, per request;
          ``False``: none, the request ended before this result came back); the other requests
          that got tokens (sampled prompts, verify rows), in batch order. A prefill chunk that
          sampled nothing reports nothing.
        """
        ib, bm = self.ib, self.bm
        decode, pos = batch.decode, batch.decode_pos
        nd = len(decode)
        new = tokens[:nd]
        if ib.epoch == batch.epoch:  # no sequence came or went since the build: same rows
            rows, live = batch.decode_rows, True
        else:
            rows = np.fromiter([s.row for s in decode], np.intp, nd)
            live = bool((rows >= 0).all())
        if live:  # every decode still runs: array writes
            ib.tokens[rows, pos] = new
            ib.times[rows, pos] = now
        else:
            for s, p, t in zip(decode, pos.tolist(), new.tolist()):
                if not s.finished:
                    s.set_sampled(p, t, now)
        for q, slot, _, p in batch.samples:
            if not q.finished:
                q.set_sampled(p, int(tokens[slot]), now)
                if q.first_token_time is None:
                    q.first_token_time = now
        if nxt is not None and nxt.fed:  # the next step's input tokens that were unknown
            # Nothing came or went since ``nxt`` was built, so its rows hold.
            known = ib.tokens[nxt.fed_rows, nxt.fed_pos]
            fed_slots = nxt.fed_pos
            if self.kv_offsets:  # a KV policy's compacted rows: slot = position - dropped
                fed_slots = np.asarray(fed_slots) - ib.dropped[nxt.fed_rows]
            bm.set_tokens(nxt.fed, fed_slots, known)
        self._mark_computed(batch, rows, live)
        lps = None if extras is None else extras.get("logprobs")
        if lps is not None:
            self._logprobs(batch, tokens, lps)
        verified = []
        for q, slot, k, start in batch.verify:  # speculative rows: keep the accepted prefix
            if not q.finished:
                verified.append(q.request_id)
                self.speculator.accept(q, start, k, tokens[slot:slot + k + 1],
                                       extras["accept"][slot:slot + k + 1], now, self)

        made: list[RequestOutput | None] = []
        if nd:
            made = self.stops_and_outputs(batch, rows, new, now, live)
        touched: dict[str, None] = dict.fromkeys(verified)
        for q, slot, count, p in batch.samples:
            if q.finished:
                continue
            touched[q.request_id] = None
            for j in range(1, count):  # parallel sampling: fork the finished prompt
                lp = None if lps is None or q.logprobs is None else _lp_dict(
                    lps, slot + j, int(tokens[slot + j]), q.params.logprobs)
                self._fork(q, j, p, int(tokens[slot + j]), now, lp)
            if q.row >= 0:
                ib.hold[q.row] = False
            self.check_stop(q, int(tokens[slot]), p + 1, now)
        return made, touched

    def _mark_computed(self, batch: StepBatch, rows: np.ndarray, live: bool) -> None:
        """The block manager keys blocks once their KV is on device: decodes whose block filled
        (it hears of a decode only then), and every other item exactly."""
        bm = self.bm
        pos = batch.decode_pos
        if self.kv_offsets:  # slots, by the rows' dropped counts now (a compaction since the
            # step was built counted its slots computed already)
            pos = pos - (self.ib.dropped[rows] if live else
                         np.array([q.num_dropped for q in batch.decode], np.int64))
        full = np.flatnonzero(pos % self.page_size == 0)
        if len(full):
            if live:
                ids = [self.ib.ids[r] for r in rows[full].tolist()]
                counts = pos[full]
            else:
                pairs = [(batch.decode[i].seq_id, int(pos[i])) for i in full.tolist()
                         if batch.decode[i].row >= 0]
                ids, counts = [p[0] for p in pairs], [p[1] for p in pairs]
            if ids:
                bm.mark_computed_many(ids, counts)
        for item, end in zip(batch.items, batch.item_ends):
            q = item.seq
            if q.row >= 0 and not item.num_draft:  # verify rows: ``Speculator.accept``
                bm.mark_computed(q.seq_id, end - q.num_dropped)

    def stops_and_outputs(self, batch: StepBatch, rows: np.ndarray, new: np.ndarray, now: float,
                          live: bool) -> list[RequestOutput | None | bool]:
        ib, decode, pos = self.ib, batch.decode, batch.decode_pos
        gone = None if live else [s.finished for s in decode]  # aborted or timed out meanwhile
        cand = batch.stop_any
        if self.eos_ids:
            eos = np.flatnonzero(new == self.eos_ids[0] if len(self.eos_ids) == 1
                                 else np.isin(new, self.eos_ids))
            if len(eos):
                watch = ib.ints[rows[eos], STOPS_ON_EOS] != 0 if live else np.ones(len(eos), bool)
                cand = np.union1d(cand, eos[watch])
        ends = (pos + 1).tolist()
        stopped = []
        for i in cand.tolist():
            s = decode[i]
            if not s.finished:
                self.check_stop(s, int(new[i]), ends[i], now)
                if s.finished:
                    stopped.append(i)  # its output is made per request, finished
        if not self.make_outputs:
            made = [False] * len(decode)
            for i in stopped:
                made[i] = None
            return made
        # None: made per request, or refreshed; False: reported only when finished
        # (``output_kind="final_only"``), so nothing is made per step.
        states = [s.out_state for s in decode]
        if None in states:
            text = self.text
            for i, s in enumerate(decode):
                if states[i] is None and s.params.n == 1:
                    states[i] = s.out_state = (
                        False if s.params.output_kind == "final_only"
                        else state_of([s], False, None, text))
        made: list[RequestOutput | None | bool] = [
            st and RequestOutput(s, end, st) for s, end, st in zip(decode, ends, states)]
        if gone is not None:
            for i, g in enumerate(gone):
                if g:
                    made[i] = False  # reported when it ended
        for i in stopped:
            made[i] = None
        return made

    def _fork(self, parent: Sequence, j: int, p: int, token: int, now: float,
              lp: dict | None = None) -> None:
        child = parent.fork(self.new_seq_id(), j, sampled=(p, token))
        if lp is not None:
            child.logprobs[-1] = lp
        self.bm.fork(parent.seq_id, child.seq_id)
        self.add_sample(child)
        self.check_stop(child, token, p + 1, now)

    def _logprobs(self, batch: StepBatch, tokens: np.ndarray, extras: tuple) -> None:
        """Records the log-probabilities the step computed: of each sampled token (for the
        sequences that asked) and of scored prompt positions."""
        decode = batch.decode
        for i in batch.lp_decodes.tolist():
            s = decode[i]
            if not s.finished:
                s.logprobs.append(_lp_dict(extras, i, int(tokens[i]), s.params.logprobs))
        for j in batch.lp_samples:
            q, slot = batch.samples[j][:2]
            if not q.finished:
                q.logprobs.append(_lp_dict(extras, slot, int(tokens[slot]), q.params.logprobs))
        target = batch.device.target
        for q, slot, first, count in batch.prompt_lp:
            if q.prompt_logprobs is not None:
                k = q.params.prompt_logprobs
                for j in range(count):
                    q.prompt_logprobs[first + j] = _lp_dict(extras, slot + j, int(target[slot + j]), k)

    def stops(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        """Why ``seq`` ends if its token at ``num_tokens - 1`` is ``token`` ("stop", "length"),
        or ``None``."""
        return stop_reason(seq, token, num_tokens, self.eos_ids, self.max_model_len, self.text)

    def check_stop(self, seq: Sequence, token: int, num_tokens: int, now: float) -> None:
        """Finishes ``seq`` if its token at ``num_tokens - 1`` (just sampled) ends it."""
        reason = self.stops(seq, token, num_tokens)
        if reason:
            self.scheduler.finish(seq, reason, now)


def _lp_dict(extras: tuple, slot: int, token: int, k: int) -> dict[int, float]:
    """Slot ``slot``'s log-probabilities: the scored ``token`` first, then the top ``k``."""
    picked, top_ids, top_lp = extras
    out = {int(token): float(picked[slot])}
    for t, lp in zip(top_ids[slot, :k].tolist(), top_lp[slot, :k].tolist()):
        out.setdefault(t, lp)
    return out
