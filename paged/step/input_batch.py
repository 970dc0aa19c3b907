"""The persistent input batch: one row per running sequence, kept across steps in numpy arrays.

A running sequence's token ids, output-token times, computed count, block-manager slot count,
block-table row, sampling parameters and stop limits live here, in row ``seq.row``; nothing else
holds a copy (``Sequence`` reads through to its row). Rows are added when a sequence starts
running (admitted, swapped in, forked) and removed when it stops (finished, preempted, swapped
out); removal moves the token state back into the sequence and condenses the batch (the last
row moves into the hole), so rows ``0 .. num_rows - 1`` are exactly the running sequences.

``epoch`` is bumped whenever the set of rows changes: "is this the batch of the last step?" is
``epoch == last_epoch`` everywhere.

Overlap: a step in flight has already advanced its rows optimistically (computed counts, one
``UNKNOWN`` token per sampling row); reading its result back fills those tokens in. ``hold``
marks rows that must sit out the next step (a prompt whose samples will be forked from the
unknown result, or a sequence that surely finishes by length with the unknown token).
"""

from __future__ import annotations

import numpy as np

from paged.kv.paging import NULL_PAGE
from paged.request.sequence import UNKNOWN, Sequence

_I32_MAX = 2**31 - 1
# Columns of a row's integer sampling parameters (the first three in DeviceBatch.smp's order).
TOP_K, SEED, SAMPLE_INDEX, LIMIT, STOPS_ON_EOS, HAS_STOP_IDS, LOGPROBS = range(7)


class InputBatch:
    """Rows of running sequences (see the module docstring).

    Args:
      max_model_len: tokens per row at most.
      pages_per_seq: width of a block-table row.
      eos_id: the tokenizer's end-of-sequence id.
    """

    def __init__(self, max_model_len: int, pages_per_seq: int, eos_id: int, capacity: int = 16):
        self.max_model_len = max_model_len
        self.pages_per_seq = pages_per_seq
        self.eos_id = eos_id
        self.num_rows = 0
        self.epoch = 0
        self.seqs: list[Sequence] = []  # by row
        self.ids: list = []  # seq_id by row
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        n, L = self.num_rows, self.max_model_len + 1  # +1: an unknown token past the limit
        old = getattr(self, "tokens", None)
        self.tokens = np.full((capacity, L), UNKNOWN, np.int32)
        self.times = np.zeros((capacity, L), np.float64)
        self.num_tokens = np.zeros(capacity, np.int32)
        self.num_computed = np.zeros(capacity, np.int32)
        self.num_slots = np.zeros(capacity, np.int32)
        self.dropped = np.zeros(capacity, np.int32)  # positions a KV policy dropped
        self.num_prompt = np.zeros(capacity, np.int32)
        self.table = np.full((capacity, self.pages_per_seq), NULL_PAGE, np.int32)
        self.num_blocks = np.full(capacity, -1, np.int32)  # blocks in the row; -1 = refresh
        self.ints = np.zeros((capacity, 7), np.int32)
        self.floats = np.zeros((capacity, 2), np.float32)  # temperature, top_p
        self.hold = np.zeros(capacity, bool)
        self.last_slot = np.full(capacity, -1, np.int32)  # its sample slot in the newest step
        if old is not None:
            for name in _ROW_ARRAYS:
                getattr(self, name)[:n] = getattr(self, "_old_" + name)
        self.capacity = capacity

    def _grow(self) -> None:
        for name in _ROW_ARRAYS:
            setattr(self, "_old_" + name, getattr(self, name)[:self.num_rows])
        self._alloc(2 * self.capacity)
        for name in _ROW_ARRAYS:
            delattr(self, "_old_" + name)

    # --- membership ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> int:
        """Gives ``seq`` the next row and moves its token state into it."""
        if seq.row >= 0:
            raise ValueError(f"sequence {seq.seq_id} already has row {seq.row}")
        if self.num_rows == self.capacity:
            self._grow()
        r = self.num_rows
        dropped = seq.num_dropped  # read before the row owns the token state
        ids, times, computed, slots = seq.give_token_state(self, r)
        n, p = len(ids), seq.num_prompt_tokens
        self.tokens[r, :n] = ids
        self.tokens[r, n:] = UNKNOWN
        self.times[r, p:p + len(times)] = times
        self.num_tokens[r], self.num_computed[r], self.num_slots[r] = n, computed, slots
        self.num_prompt[r] = p
        self.dropped[r] = dropped
        self.num_blocks[r] = -1
        self.hold[r] = bool(n) and ids[-1] == UNKNOWN
        prm = seq.params
        limit = min(p + prm.max_tokens, self.max_model_len, _I32_MAX)
        self.ints[r] = (min(prm.top_k, _I32_MAX), seq.seed, seq.sample_index, limit,
                        not prm.ignore_eos, bool(prm.stop_token_ids or prm.stop),
                        -1 if prm.logprobs is None else prm.logprobs)
        self.floats[r] = (prm.temperature, prm.top_p)
        self.seqs.append(seq)
        self.ids.append(seq.seq_id)
        self.num_rows = r + 1
        self.epoch += 1
        return r

    def remove(self, seq: Sequence) -> None:
        """Moves ``seq``'s token state back into it and condenses the rows."""
        r = seq.row
        if r < 0 or r >= self.num_rows or self.seqs[r] is not seq:
            raise ValueError(f"sequence {seq.seq_id} has no row in this batch")
        n, p = int(self.num_tokens[r]), int(self.num_prompt[r])
        known = n - 1 if n and self.tokens[r, n - 1] == UNKNOWN else n
        seq.take_token_state(self.tokens[r, :n].tolist(), self.times[r, p:known].tolist(),
                             int(self.num_computed[r]), int(self.num_slots[r]))
        seq.num_dropped = int(self.dropped[r])
        last = self.num_rows - 1
        if r != last:  # the last row fills the hole
            for name in _ROW_ARRAYS:
                a = getattr(self, name)
                a[r] = a[last]
            moved = self.seqs[r] = self.seqs[last]
            self.ids[r] = self.ids[last]
            moved.row = r
        self.seqs.pop()
        self.ids.pop()
        self.num_rows = last
        self.epoch += 1

    # --- reads -----------------------------------------------------------------------------
    def token_ids(self, r: int) -> list[int]:
        return self.tokens[r, :self.num_tokens[r]].tolist()

    def token_times(self, r: int) -> list[float]:
        n, p = int(self.num_tokens[r]), int(self.num_prompt[r])
        if n and self.tokens[r, n - 1] == UNKNOWN:
            n -= 1
        return self.times[r, p:n].tolist()

    def decoders(self) -> np.ndarray:
        """Rows with one token left to compute, past the prompt, not held (ascending)."""
        n = self.num_rows
        nt, nc = self.num_tokens[:n], self.num_computed[:n]
        mask = (nt - nc == 1) & (nc >= self.num_prompt[:n]) & (self.num_slots[:n] == nc)
        mask &= ~self.hold[:n]
        return np.flatnonzero(mask)

    def refresh(self, r: int, table: list[int]) -> None:
        """Copies a block table (from the block manager) into row ``r``."""
        k = len(table)
        self.table[r, :k] = table
        self.table[r, k:] = NULL_PAGE
        self.num_blocks[r] = k

    def check(self, bm) -> None:
        """Debug: every row agrees with its sequence and the block manager."""
        for r in range(self.num_rows):
            seq = self.seqs[r]
            if seq.row != r or self.ids[r] != seq.seq_id:
                raise AssertionError(f"row {r} holds {seq!r} (ids {self.ids[r]})")
            if self.num_slots[r] - self.dropped[r] != bm.num_tokens(seq.seq_id):
                raise AssertionError(f"sequence {seq.seq_id}: num_slots={self.num_slots[r]} "
                                     f"(dropped {self.dropped[r]}) but the block manager holds "
                                     f"{bm.num_tokens(seq.seq_id)}")
            known = self.num_tokens[r] - (self.tokens[r, self.num_tokens[r] - 1] == UNKNOWN)
            if (self.tokens[r, :known] == UNKNOWN).any():
                raise AssertionError(f"sequence {seq.seq_id}: an unknown token before its last")


_ROW_ARRAYS = ("tokens", "times", "num_tokens", "num_computed", "num_slots", "dropped", "num_prompt",
               "table",
               "num_blocks", "ints", "floats", "hold", "last_slot")
