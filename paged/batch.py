"""Builds one step's device batch on the host (numpy), padded to power-of-two buckets.

Bucketing keeps the number of distinct shapes (and so XLA compilations) small: tokens, sequences
and sample slots are each rounded up to a power of two. Padding tokens write into the null page;
padding sequences have ``kv_len = 0`` and an empty query range.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

import flax
import jax
import numpy as np

from paged.kv_cache import NULL_PAGE, next_pow2
from paged.models.attention import AttentionMetadata
from paged.sequence import Sequence

MIN_TOKENS = 8  # smallest token bucket: tiny batches share one compilation


@flax.struct.dataclass
class DeviceBatch:
    """Everything the jitted step reads; shapes are bucketed.

    Packed into five arrays, one per length (each is one host fill and one transfer); the named
    fields are views, on the host and inside the jitted step alike.
    """

    tok: jax.Array  # i32[3, T]: token ids, positions, slot mapping
    seq: jax.Array  # i32[2, S + 1]: kv_lens then num_seqs; cu_q_lens
    page_indices: jax.Array  # i32[S, pages_per_seq]
    smp: jax.Array  # i32[5, N]: sample_rows, top_k, seed, sample_index, sample_pos
    smp_f: jax.Array  # f32[2, N]: temperature, top_p

    tokens = property(lambda self: self.tok[0])  # i32[T]
    positions = property(lambda self: self.tok[1])  # i32[T]
    sample_rows = property(lambda self: self.smp[0])  # i32[N]: token row each sample slot reads
    top_k = property(lambda self: self.smp[1])  # i32[N]
    seed = property(lambda self: self.smp[2])  # i32[N]
    sample_index = property(lambda self: self.smp[3])  # i32[N]
    sample_pos = property(lambda self: self.smp[4])  # i32[N]: position of the sampled token
    temperature = property(lambda self: self.smp_f[0])  # f32[N]
    top_p = property(lambda self: self.smp_f[1])  # f32[N]

    @property
    def md(self) -> AttentionMetadata:
        s = self.page_indices.shape[0]
        return AttentionMetadata(slot_mapping=self.tok[2], page_indices=self.page_indices,
                                 kv_lens=self.seq[0, :s], cu_q_lens=self.seq[1],
                                 num_seqs=self.seq[0, s:])


@dataclasses.dataclass
class StepBatch:
    device: DeviceBatch
    samples: list[tuple[Sequence, int, int]]  # (sequence, first sample slot, number of slots)
    num_tokens: int
    num_seqs: int
    num_decode: int = 0  # the first sequences / sample slots are the fast-path decodes, in order
    rows: np.ndarray | None = None  # each sequence's builder row, in batch order
    starts: np.ndarray | None = None  # each sequence's num_computed_tokens before the built step
    num_advanced: int = 0  # steps this batch was advanced since built: it is now at starts + this
    # Decodes that end whatever they sample (length limit) or may (stop ids); whether each stops
    # on EOS (nonzero). Known before the step, so that little is left to do after it.
    stop_any: list[int] = dataclasses.field(default_factory=list)
    stop_eos: np.ndarray | None = None
    # For advancing a decode-only batch without looking at every sequence (``BatchBuilder``):
    # advance j needs new pages for the decodes in ``new_block[j % page_size]``; decode
    # ``stop_order[i]`` is a stop candidate from advance ``stop_from[i]`` on (ascending).
    new_block: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    stop_order: np.ndarray | None = None
    stop_from: list[int] = dataclasses.field(default_factory=list)


class BatchBuilder:
    """Turns the scheduler's choice into a ``DeviceBatch``.

    Every running sequence owns a row of persistent host tables (its block table and sampling
    parameters), assigned the first time it is batched and given back by ``release`` when it stops
    running. A steady decoder's row changes only when it gains a block (every ``page_size`` tokens)
    or copies its tail on write, so building a decode step gathers rows instead of converting
    every block table again.
    """

    def __init__(self, block_manager, page_size: int, pages_per_seq: int, *,
                 min_tokens: int = MIN_TOKENS, min_seqs: int = 1, max_model_len: int | None = None,
                 eos_id: int = -1, debug: bool = False):
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.eos_id = eos_id
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.min_tokens = min_tokens
        self.min_seqs = min_seqs
        self.debug = debug
        self._free_rows: list[int] = []
        self._prev: tuple[list[Sequence], StepBatch] | None = None  # the last decode-only batch
        self._grow_rows(16)

    def _grow_rows(self, capacity: int) -> None:
        old = getattr(self, "_table", None)
        n = 0 if old is None else old.shape[0]
        table = np.full((capacity, self.pages_per_seq), NULL_PAGE, np.int32)
        nblocks = np.full(capacity, -1, np.int64)  # blocks in the row; -1 = must be refreshed
        ints = np.zeros((capacity, len(_INT_PARAMS)), np.int32)
        floats = np.zeros((capacity, 2), np.float32)  # temperature, top_p
        if old is not None:
            table[:n], nblocks[:n], ints[:n], floats[:n] = old, self._nblocks, self._ints, self._floats
        self._table, self._nblocks, self._ints, self._floats = table, nblocks, ints, floats
        self._free_rows.extend(range(capacity - 1, n - 1, -1))  # pop() hands out low rows first

    @property
    def num_rows_in_use(self) -> int:
        return self._table.shape[0] - len(self._free_rows)

    def release(self, seq: Sequence) -> None:
        """Gives back ``seq``'s row (it stopped running: finished, preempted or swapped out)."""
        if seq.row >= 0:
            self._free_rows.append(seq.row)
            seq.row = -1

    def _assign(self, seq: Sequence) -> int:
        if not self._free_rows:
            self._grow_rows(2 * self._table.shape[0])
        row = seq.row = self._free_rows.pop()
        p = seq.params
        limit = min(seq.num_prompt_tokens + p.max_tokens, self.max_model_len or _I32_MAX, _I32_MAX)
        if p.stop_token_ids:
            limit = 0  # any token may end it: always a stop candidate
        self._ints[row] = (min(p.top_k, _I32_MAX), seq.seed, seq.sample_index, limit, not p.ignore_eos)
        self._floats[row] = (p.temperature, p.top_p)
        self._nblocks[row] = -1
        return row

    def _refresh(self, seq: Sequence) -> None:
        """Copies ``seq``'s block table from the block manager into its row."""
        table = self.bm.block_table(seq.seq_id)
        row, n = seq.row, len(table)
        self._table[row, :n] = table
        self._table[row, n:] = NULL_PAGE
        self._nblocks[row] = n

    def buckets(self, num_tokens: int, num_seqs: int, num_samples: int) -> tuple[int, int, int]:
        """Padded (tokens, sequences, sample slots) of a step."""
        t_pad = next_pow2(max(num_tokens, self.min_tokens))
        s_pad = next_pow2(max(num_seqs, self.min_seqs))
        return t_pad, s_pad, max(s_pad, next_pow2(num_samples))

    def empty(self, t_pad: int, s_pad: int, n_pad: int) -> DeviceBatch:
        """An all-padding batch of the given shape (compiles the step without touching real KV):
        tokens write the null page, sequences have no keys, samples are greedy."""
        smp_f = np.zeros((2, n_pad), np.float32)
        smp_f[1] = 1.0  # top_p
        tok = np.zeros((3, t_pad), np.int32)
        tok[2] = NULL_PAGE * self.page_size  # slot mapping
        return DeviceBatch(tok=tok,
                           seq=np.zeros((2, s_pad + 1), np.int32),
                           page_indices=np.full((s_pad, self.pages_per_seq), NULL_PAGE, np.int32),
                           smp=np.zeros((5, n_pad), np.int32), smp_f=smp_f)

    def build(self, scheduled, decode: list[Sequence] = (), decode_tokens: list[int] = (),
              copies: bool = False) -> StepBatch:
        """The step's batch: ``decode`` sequences first (one token each, ``decode_tokens``), then
        the ``scheduled`` items. ``copies``: the step copies pages on write, so rows are refreshed.

        When the step repeats the last one's decodes (the same list: every sequence one token
        further), the last batch's arrays are advanced in place instead of rebuilt; the caller
        must be done with the last batch (its device call has returned).
        """
        prev, self._prev = self._prev, None
        if prev is not None and decode is prev[0] and not scheduled and not copies:
            batch = self._advance(prev[1], decode, decode_tokens)
            if self.debug:  # equal to a batch built from scratch
                want = self._build(scheduled, decode, decode_tokens, copies)
                for a, b in zip(jax.tree_util.tree_leaves(batch.device),
                                jax.tree_util.tree_leaves(want.device), strict=True):
                    np.testing.assert_array_equal(a, b, err_msg="advanced batch differs")
                assert batch.stop_any == want.stop_any, (batch.stop_any, want.stop_any)
                assert (batch.starts + batch.num_advanced).tolist() == want.starts.tolist()
        else:
            batch = self._build(scheduled, decode, decode_tokens, copies)
        if not scheduled and decode:
            self._prev = (decode, batch)
        return batch

    def _advance(self, prev: StepBatch, decode: list[Sequence], decode_tokens: list[int]) -> StepBatch:
        """``prev``'s decodes one token further, in place: positions, lengths and slots move by
        one; only sequences that start a block are looked up again (known from ``prev``)."""
        nd, page_size = len(decode), self.page_size
        j = prev.num_advanced = prev.num_advanced + 1
        device = prev.device
        tok, seq, pages, smp = device.tok, device.seq, device.page_indices, device.smp
        tok[0, :nd] = decode_tokens
        tok[1:3, :nd] += 1  # positions; the next slot of the same page...
        seq[0, :nd] += 1  # kv_lens
        smp[4, :nd] += 1  # sample_pos
        starting = prev.new_block.get(j % page_size)
        if starting:  # ...except where a new page starts
            rows, table = prev.rows, self._table
            for i in starting:
                self._refresh(decode[i])
                row, c = rows[i], int(tok[1, i])
                pages[i] = table[row]
                tok[2, i] = table[row, c // page_size] * page_size + c % page_size
        stop_from = prev.stop_from
        if stop_from and stop_from[0] <= j:
            n = bisect.bisect_right(stop_from, j)
            prev.stop_any = sorted(prev.stop_order[:n].tolist())
        return prev

    def _build(self, scheduled, decode, decode_tokens, copies) -> StepBatch:
        page_size = self.page_size
        nd = len(decode)
        rows = [q.row for q in decode]
        if nd and min(rows) < 0:  # forked samples join the decode path without a row
            rows = [r if r >= 0 else self._assign(q) for q, r in zip(decode, rows)]
        starts_d = np.fromiter([q.num_computed_tokens for q in decode], np.int32, nd)
        rows_d = np.asarray(rows, np.intp)
        stale = (np.arange(nd) if copies else np.flatnonzero(
            np.take(self._nblocks, rows_d) != starts_d // page_size + 1))
        for i in stale.tolist():
            self._refresh(decode[i])

        # The other items, one Python pass (they are few: prefill chunks, odd decodes).
        seqs = decode
        q_lens, starts, token_chunks = [], [], [decode_tokens]
        samples = []  # (sequence, first sample slot, number of slots) of the items
        rows_o, slot_seq, slot_j = [], [], []  # per sample slot after the decodes
        if scheduled:
            seqs = list(decode)
        for i, item in enumerate(scheduled, start=nd):
            q, n = item.seq, item.num_new_tokens
            c = q.num_computed_tokens
            if q.row < 0:
                self._assign(q)
            self._refresh(q)
            seqs.append(q)
            rows_o.append(q.row)
            q_lens.append(n)
            starts.append(c)
            token_chunks.append(q.token_ids[c:c + n])
            if c + n == q.num_tokens:  # reaches its end: sample (n slots for an unforked prompt)
                count = q.params.n if q.sample_index == 0 and q.num_output_tokens == 0 else 1
                samples.append((q, nd + len(slot_seq), count))
                slot_seq.extend([i] * count)
                slot_j.extend(range(count))
        s = len(seqs)
        n_rows = nd + len(slot_seq)
        if scheduled:
            q_lens = np.concatenate([np.ones(nd, np.int32), np.asarray(q_lens, np.int32)])
            starts = np.concatenate([starts_d, np.asarray(starts, np.int32)])
            all_rows = np.concatenate([rows_d, np.asarray(rows_o, np.intp)])
            slot_idx = np.concatenate([np.arange(nd), np.asarray(slot_seq, np.intp)])  # batch index
            t = int(q_lens.sum())
        else:  # decodes only: token i, sequence i and sample slot i go together
            starts, all_rows, t = starts_d, rows_d, nd
        t_pad, s_pad, n_pad = self.buckets(t, s, n_rows)
        device = self.empty(t_pad, s_pad, n_pad)
        tok, seq, pages, smp, smp_f = (device.tok, device.seq, device.page_indices, device.smp,
                                       device.smp_f)

        np.take(self._table, all_rows, axis=0, out=pages[:s])
        kv_lens = seq[0, :s]
        cu = seq[1]
        seq[0, s_pad] = s  # num_seqs
        if scheduled:
            tok[0, :t] = list(itertools.chain.from_iterable(token_chunks))
            np.cumsum(q_lens, out=cu[1:s + 1])
            cu[s + 1:] = t
            owner = np.repeat(np.arange(s), q_lens)
            pos = np.arange(t) - np.take(cu, owner) + np.take(starts, owner)
            np.add(starts, q_lens, out=kv_lens)
            smp[0, :n_rows] = np.take(cu, slot_idx + 1) - 1  # each sample reads its row's last token
            smp[4, :n_rows] = np.take(kv_lens, slot_idx)
            slot_rows = np.take(all_rows, slot_idx)
        else:
            tok[0, :t] = decode_tokens
            cu[:s + 1] = owner = np.arange(s + 1)
            cu[s + 1:] = t
            owner = owner[:s]
            pos = starts
            np.add(starts, 1, out=kv_lens)
            smp[0, :n_rows] = owner
            smp[4, :n_rows] = kv_lens
            slot_rows = all_rows
        tok[1, :t] = pos
        tok[2, :t] = pages[owner, pos // page_size] * page_size + pos % page_size
        ints = np.take(self._ints, slot_rows, axis=0)  # [n_rows, _INT_PARAMS]
        smp[1:4, :n_rows] = ints[:, :3].T  # top_k, seed, sample_index
        if slot_j:
            smp[3, nd:n_rows] += np.asarray(slot_j, np.int32)
        smp_f[:, :n_rows] = np.take(self._floats, slot_rows, axis=0).T  # temperature, top_p

        # Stop conditions of the decodes, known before the step: a candidate once it holds its
        # limit after the new token, i.e. from advance ``limit - start - 2`` on.
        stop_first = ints[:nd, _LIMIT].astype(np.int64) - starts_d - 2
        stop_any = np.flatnonzero(stop_first <= 0).tolist()
        stop_eos = ints[:nd, _STOPS_ON_EOS]
        if self.debug:
            self._check(seqs, pages)
        batch = StepBatch(device=device, samples=samples, num_tokens=t, num_seqs=s, num_decode=nd,
                          rows=all_rows, starts=starts, stop_any=stop_any, stop_eos=stop_eos)
        if nd and not scheduled:  # what advancing it needs
            order = np.argsort(stop_first, kind="stable")
            batch.stop_order, batch.stop_from = order, stop_first[order].tolist()
            # Advance j writes position start + j: a new page when that is a multiple of page_size.
            residue = (-starts_d) % page_size
            for r in np.unique(residue).tolist():
                batch.new_block[r] = np.flatnonzero(residue == r).tolist()
        return batch

    def stop_candidates(self, batch: StepBatch, new_tokens: list[int]) -> list[int]:
        """Indices among the batch's decodes whose sampled token may end them (EOS, a stop id, or
        the length limit), ascending; the caller decides exactly. Most decodes cost nothing."""
        if self.eos_id not in new_tokens:
            return batch.stop_any
        eos, watch = self.eos_id, batch.stop_eos
        hits = [i for i, t in enumerate(new_tokens) if t == eos and watch[i]]
        return sorted(set(batch.stop_any).union(hits))

    def _check(self, seqs: list[Sequence], page_indices: np.ndarray) -> None:
        """Debug: every batched row equals the block manager's table (a stale row would attend to,
        or write into, another sequence's pages)."""
        for i, q in enumerate(seqs):
            table = self.bm.block_table(q.seq_id)
            got = page_indices[i, :len(table)].tolist()
            if got != table or (page_indices[i, len(table):] != NULL_PAGE).any():
                raise AssertionError(f"stale batch row for sequence {q.seq_id}: {got} vs {table}")


# Columns of a row's integer parameters (the first three in DeviceBatch.smp's order); "limit": a
# stop candidate once it holds this many tokens (0 with stop ids: always).
_INT_PARAMS = ("top_k", "seed", "sample_index", "limit", "stops_on_eos")
_TOP_K, _SEED, _SAMPLE_INDEX, _LIMIT, _STOPS_ON_EOS = range(len(_INT_PARAMS))
_I32_MAX = 2**31 - 1
