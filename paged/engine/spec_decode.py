"""Speculative decoding: propose k tokens per decoding sequence, verify them in the same ragged
step as everything else, keep the accepted prefix and roll back the rest.

Per step (the engine's ``Speculator`` does this between scheduling and building the batch):

1. the scheduler served the decodes as usual (one slot each, the batched path);
2. for each such decode, in row order, a proposer offers up to k tokens (``NgramProposer``:
   the continuation of the last earlier occurrence of the sequence's final n-gram, n from
   ``ngram_max`` down to ``ngram_min``);
3. the budget rule: a decode may take ``k_i = min(k, len(proposal), room, budget)`` extra tokens,
   where ``room`` keeps prompt + output within ``max_tokens`` and ``max_model_len`` and ``budget``
   is what is left of ``max_num_batched_tokens`` after the scheduled tokens, spent in row order
   (so a request's k is cut only when the step is full);
4. ``k_i`` lookahead slots are reserved in the block manager with the proposed token ids; the
   decode becomes a verify row of ``1 + k_i`` tokens whose every position is sampled;
5. on device, slot j accepts draft token ``d`` with probability ``min(1, p(d) / q(d))`` (q is a
   point mass for n-gram proposals, so ``p(d)``) and otherwise samples from
   ``norm(max(0, p - q))``; the slot after the last draft samples from ``p`` (Leviathan et al.).
   Greedy sampling accepts exactly the drafts equal to the argmax, so the output is token for
   token the non-speculative one;
6. reading back: the accepted drafts and one more token are kept; the rejected positions' slots
   are rolled back (a trailing block left empty goes back to the pool), and only the accepted
   prefix is marked computed, so staged positions never enter the prefix cache.

Speculation needs the previous step's tokens on the host to propose, so an engine with
``speculative`` set runs its steps serially (``async_scheduling`` is not used).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from paged.config.speculative import SpeculativeConfig
from paged.request.sequence import UNKNOWN


class DraftModel:
    """A draft model's params and its own KV cache, on the target's pages and block tables.

    The cache has the target's pool shape (same pages, same page size) with the draft's layers,
    KV heads and head dim: page p holds the draft's KV for the tokens whose target KV is in page
    p, so the block manager, the prefix cache and the tables serve both. Every target step also
    runs the draft over the same batch (``forward``), so its cache covers what the target's does;
    copy-on-write and swap copies are applied to both caches (poisoning, a debug aid, only to the
    target's: the draft's distributions only steer proposals, never outputs).
    """

    def __init__(self, model_config, params, num_pages: int, page_size: int, dtype: str,
                 attention_impl: str, host_blocks: int = 0, placement=None):
        import jax

        from paged.engine.device_step import make_draft_fns
        from paged.kv import cache as kc

        self.config = model_config
        if placement is not None and model_config.num_kv_heads % placement.size:
            raise ValueError(f"draft num_kv_heads={model_config.num_kv_heads} is not divisible "
                             f"by tensor_parallel_size={placement.size}")
        self.params = jax.device_put(params) if placement is None else placement.put_params(params)
        self.cache = kc.KVCache.create(model_config.num_layers, model_config.num_kv_heads,
                                       num_pages, page_size, model_config.head_dim, dtype,
                                       sharding=None if placement is None else placement.kv)
        self.forward, self.propose = make_draft_fns(model_config, attention_impl)
        self.host_k = self.host_v = None
        if host_blocks:
            self.host_k, self.host_v = kc.host_buffers(self.cache, host_blocks)

    def mirror(self, device_batch) -> None:
        """Writes the draft's KV for a target step's batch."""
        self.cache = self.forward(self.params, self.cache, device_batch)


class NgramProposer:
    """Prompt lookup: the tokens that followed an earlier occurrence of the final n-gram (the
    latest one followed by k tokens, else the latest)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.ns = range(config.ngram_max, config.ngram_min - 1, -1)

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens`` (i32[n], all known), longest n-gram first."""
        size = len(tokens)
        for n in self.ns:
            if size <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):  # the latest occurrence followed by k tokens, else the latest
                full = hits[hits + n + k <= size]
                start = int(full[-1] if len(full) else hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []


@dataclasses.dataclass
class SpecStats:
    """Counters in vLLM's names: proposals made (``num_drafts``: verify rows), tokens proposed,
    tokens accepted; and how many tokens each verify row emitted, and how many rows rejected a
    draft. ``per_token_acceptance`` is accepted / (accepted + rejections): the drafts after a
    rejection are never judged, so this (not ``draft_acceptance_rate``) estimates the per-token
    acceptance probability of the speculative-decoding analysis."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_rejections: int = 0  # verify rows that rejected one of their drafts

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["draft_acceptance_rate"] = (self.num_accepted_tokens / self.num_draft_tokens
                                      if self.num_draft_tokens else 0.0)
        d["mean_accepted_length"] = (self.num_accepted_tokens / self.num_drafts
                                     if self.num_drafts else 0.0)
        d["mean_emitted_per_verify"] = (self.num_emitted_tokens / self.num_drafts
                                        if self.num_drafts else 0.0)
        judged = self.num_accepted_tokens + self.num_rejections
        d["per_token_acceptance"] = self.num_accepted_tokens / judged if judged else 0.0
        return d


class Speculator:
    """Turns a scheduled step's batched decodes into verify rows (see the module docstring).

    Args:
      config: the speculative settings.
      batch: the engine's input batch; bm: its block manager; max_num_batched_tokens: the
        step's token budget.
    """

    def __init__(self, config: SpeculativeConfig, batch, bm, max_num_batched_tokens: int,
                 draft: DraftModel | None = None, builder=None):
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config)
        self.draft, self.builder = draft, builder
        if builder is not None:  # verify steps: one sample-slot count per bucket
            builder.verify_slots = self.k + 1
        self._pending: list = []  # draft method: (row, seq, k) reserved, to draft after the copies
        self._q = None  # draft method: the drafts' distributions on device, f32[M, V]
        self._q_rows: dict = {}  # seq_id -> row of ``_q`` per draft position
        self.ib, self.bm = batch, bm
        self.budget = max_num_batched_tokens
        self.stats = SpecStats()
        self.num_staged = 0  # slots holding proposed tokens not verified yet (0 between steps)

    def plan(self, sched) -> None:
        """Moves the decodes that get proposals out of ``sched.decode_rows`` into
        ``sched.scheduled`` as verify items (``ScheduledSeq.num_draft``), reserving their slots."""
        from paged.step.input_batch import LIMIT
        from paged.step.scheduler import ScheduledSeq

        ib, bm = self.ib, self.bm
        left = self.budget - sched.num_batched_tokens
        if left <= 0 or not len(sched.decode_rows):
            return
        keep = []
        self._pending = []
        for r in sched.decode_rows.tolist():
            nt = int(ib.num_tokens[r])
            room = int(ib.ints[r, LIMIT]) - nt - 1
            want = min(self.k, room, left)
            if self.draft is not None:  # slots now (unknown tokens), drafts after the copies
                seq = ib.seqs[r]
                if want > 0 and seq.params.logprobs is None:
                    pairs = bm.reserve_lookahead(seq.seq_id, want)
                    if pairs is not None:
                        sched.copies.extend(pairs)
                        ib.num_slots[r] += want
                        self._pending.append((r, seq, want))
                        sched.scheduled.append(ScheduledSeq(seq, 1 + want, num_draft=want))
                        self.num_staged += want
                        left -= want
                        continue
                keep.append(r)
                continue
            toks = ib.tokens[r, :nt]
            drafts = [] if want <= 0 or UNKNOWN in toks[-1:] or ib.seqs[r].params.logprobs \
                is not None else self.proposer.propose(toks, want)
            if drafts:
                seq = ib.seqs[r]
                pairs = bm.reserve_lookahead(seq.seq_id, len(drafts), drafts)
                if pairs is not None:
                    sched.copies.extend(pairs)
                    k = len(drafts)
                    ib.tokens[r, nt:nt + k] = drafts
                    ib.num_tokens[r] = nt + k
                    ib.num_slots[r] += k
                    sched.scheduled.append(ScheduledSeq(seq, 1 + k, num_draft=k))
                    self.num_staged += k
                    left -= k
                    continue
            keep.append(r)
        sched.decode_rows = np.asarray(keep, np.intp)

    def draft_tokens(self) -> None:
        """Draft method, after the step's copies ran on both caches: k draft steps over the
        reserved rows (each writes the draft's KV for its input token and samples the next), the
        drafts written into the rows and told to the block manager."""
        if not self._pending:
            return
        ib, d = self.ib, self.draft
        rows = np.asarray([r for r, _, _ in self._pending], np.intp)
        ks = np.asarray([k for _, _, k in self._pending])
        p0 = ib.num_computed[rows].copy()  # the position of each row's input token
        ib.num_blocks[rows] = -1  # their tables grew by the lookahead: refresh the rows
        probs, offset = [], 0
        self._q_rows = {seq.seq_id: [] for _, seq, _ in self._pending}
        for j in range(1, int(ks.max()) + 1):  # step j: input at p0 + j - 1, samples p0 + j
            sel = np.flatnonzero(ks >= j)
            rj = rows[sel]
            ib.num_computed[rj] = p0[sel] + j - 1
            batch = self.builder.build(rj, [], copies=False, cascade=False)
            d.cache, toks, q = d.propose(d.params, d.cache, batch.device)
            ib.tokens[rj, p0[sel] + j] = np.asarray(toks)[:len(rj)]
            for i, idx in enumerate(sel.tolist()):
                self._q_rows[self._pending[idx][1].seq_id].append(offset + i)
            probs.append(q)
            offset += q.shape[0]
        ib.num_computed[rows] = p0
        self._q = probs[0] if len(probs) == 1 else jnp.concatenate(probs)
        ids, pos, toks = [], [], []
        for r, seq, k in self._pending:
            nt = int(ib.num_tokens[r])
            ids += [seq.seq_id] * k
            pos += list(range(nt, nt + k))
            toks += ib.tokens[r, nt:nt + k].tolist()
            ib.num_tokens[r] = nt + k
        self.bm.set_tokens(ids, pos, toks)
        self._pending = []

    def verify_inputs(self, batch):
        """``(q, q_index)`` for the verify step: each verify slot's row of the drafts'
        distributions (draft method), or ``(None, None)`` (point masses: n-gram)."""
        if self.draft is None or not batch.verify:
            return None, None
        q_index = np.full(batch.device.smp.shape[1], -1, np.int32)
        for seq, slot, k, _ in batch.verify:
            q_index[slot:slot + k] = self._q_rows[seq.seq_id][:k]
        return self._q, q_index

    def accept(self, seq, start: int, k: int, tokens: np.ndarray, accepted: np.ndarray, now: float,
               reader) -> None:
        """Applies one verify row's result: ``start`` is the position of its input token,
        ``tokens``/``accepted`` its k + 1 slots. Keeps the accepted drafts and one more token (cut
        at a stop), rolls back the rest, marks the kept prefix computed, and stops the sequence if
        one of its new tokens ends it."""
        a = int(np.argmin(accepted[:k])) if not accepted[:k].all() else k
        self.num_staged -= k
        ib, r = self.ib, seq.row
        drafts = ib.tokens[r, start + 1:start + 1 + k].tolist()
        emitted = drafts[:a] + [int(tokens[a])]
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += k
        self.stats.num_accepted_tokens += a
        self.stats.num_rejections += a < k
        cut = len(emitted)
        for i, t in enumerate(emitted):  # nothing after a stop may reach the sequence
            if reader.stops(seq, t, start + 2 + i):
                cut = i + 1
                break
        emitted = emitted[:cut]
        self.stats.num_emitted_tokens += cut
        n_new = start + 1 + cut  # tokens now; the last one is not computed
        ib.tokens[r, start + 1:n_new] = emitted
        ib.times[r, start + 1:n_new] = now
        ib.num_tokens[r] = n_new
        ib.num_computed[r] = n_new - 1
        ib.hold[r] = False
        extra = int(ib.num_slots[r]) - (n_new - 1)  # slots past the kept, computed prefix
        if extra:
            self.bm.rollback(seq.seq_id, extra)  # a trailing block may go back to the pool
            ib.num_slots[r] = n_new - 1
            ib.num_blocks[r] = -1  # its table row is refreshed at the next build
        self.bm.mark_computed(seq.seq_id, n_new - 1)
        reader.check_stop(seq, emitted[-1], n_new, now)


def load_draft(config, model_config, num_pages, page_size, host_blocks, placement=None):
    """The draft model of ``speculative.method == "draft"`` (checked against the target)."""
    spec = config.speculative
    if spec is None or spec.method != "draft":
        return None
    from paged.models.registry import load_any

    draft_config, draft_params, _ = load_any(spec.model, dtype=config.dtype)
    if draft_config.vocab_size != model_config.vocab_size:
        raise ValueError(f"draft model {spec.model!r} has vocab_size="
                         f"{draft_config.vocab_size}, the target {model_config.vocab_size}")
    if draft_config.max_seq_len < config.max_model_len:
        raise ValueError(f"draft model {spec.model!r} serves max_seq_len="
                         f"{draft_config.max_seq_len} < max_model_len={config.max_model_len}")
    return DraftModel(draft_config, draft_params, num_pages, page_size, config.dtype,
                      config.attention_impl, host_blocks, placement)
