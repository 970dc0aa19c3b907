"""What a finished step tells the host: how many slots are computed, and token ids that arrived late.

Full blocks get their prefix-cache keys once their KV is on device and every token id in them is
known: in ``mark_computed`` for the blocks it completes, and in ``set_tokens`` for computed blocks
that only waited for a token id.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paged.kv.blocks.prefix_index import PrefixKeyer
from paged.kv.blocks.tables import TOKEN_LIMIT, Seq, SeqTables, count_arg
from paged.kv.blocks.token_rows import UNKNOWN_ID, int_array

_FEW = 32  # batches up to this size are marked by a Python pass (`Progress._mark_few`)
_INT = {int}


class Progress:
    """``mark_computed``, ``mark_computed_many`` and ``set_tokens`` over the sequence tables."""

    def __init__(self, tables: SeqTables, keyer: PrefixKeyer):
        self.tables = tables
        self.keyer = keyer

    def mark_computed(self, seq_id, num_computed_tokens: int) -> None:
        try:
            seq = self.tables.seqs[seq_id]
        except (KeyError, TypeError):
            seq = self.tables.get(seq_id)  # raises
        c = num_computed_tokens
        rows, r = self.tables.rows, seq.row
        if type(c) is int and rows.computed[r] <= c < rows.key_at[r] and c <= rows.n[r]:
            rows.computed[r] = c  # the decode fast path: no block completed
            return
        if seq.host_table is not None or type(c) is not int or not (
                seq.num_computed <= c <= seq.num_tokens):
            c = self._check_computed(seq_id, seq, c)
        seq.num_computed = c
        self.keyer.key_computed((seq,))

    def mark_computed_many(self, seq_ids: Sequence, num_computed_tokens: Sequence[int]) -> None:
        tables = self.tables
        batch = tables.lookup(seq_ids, num_computed_tokens)
        counts = num_computed_tokens
        if len(batch) <= _FEW:
            if self._mark_few(batch, counts):
                return
            C = None
        else:
            C = int_array(counts)
        if C is not None:  # array operations over the batch's rows
            rows = tables.rows
            R = tables.rows_of(batch)
            if not len(R) or ((rows.computed[R] <= C) & (C <= rows.n[R])).all():
                due = np.flatnonzero(C >= rows.key_at[R])
                keying = [batch[i] for i in due.tolist()]
                if all(seq.host_table is None for seq in keying):
                    rows.computed[R] = C
                    if keying:
                        self.keyer.key_computed(keying, R[due])
                    return
        counts = [self._check_computed(s, q, n)  # raises, or converts int-like counts
                  for s, q, n in zip(seq_ids, batch, counts, strict=True)]
        for seq, c in zip(batch, counts, strict=True):
            seq.num_computed = c
        self.keyer.key_computed([seq for seq, c in zip(batch, counts) if c >= seq.key_at])

    def _mark_few(self, batch: list[Seq], counts) -> bool:
        """``mark_computed_many`` of a few sequences (a readback's filled blocks): one gather
        per counter and a Python pass, cheaper than array operations at this size. ``False``
        (nothing changed) when a count needs the checked path."""
        if isinstance(counts, np.ndarray) and counts.ndim == 1 and counts.dtype.kind in "iu":
            counts = counts.tolist()
        if type(counts) is not list or not set(map(type, counts)) <= _INT:
            return False
        rows = self.tables.rows
        R = self.tables.rows_of(batch)
        keying, kcs = [], []
        for seq, c, nc, n, ka in zip(batch, counts, rows.computed[R].tolist(),
                                     rows.n[R].tolist(), rows.key_at[R].tolist()):
            if not nc <= c <= n:
                return False
            if c >= ka:
                if seq.host_table is not None:
                    return False
                keying.append(seq)
                kcs.append(c)
        rows.computed[R] = counts
        if keying:
            self.keyer.key_computed(keying, [seq.row for seq in keying], kcs)
        return True

    def _check_computed(self, seq_id, seq: Seq, c) -> int:
        if seq.host_table is not None:
            self.tables.resident(seq_id)  # raises
        n = seq.num_tokens
        if type(c) is not int or not seq.num_computed <= c <= n:
            c = count_arg(c, "num_computed_tokens")
            if not seq.num_computed <= c <= n:
                raise ValueError(
                    f"num_computed_tokens={c} must be in [{seq.num_computed}, {n}] "
                    f"for sequence {seq_id!r} (use rollback to shrink)")
        return c

    def set_tokens(self, seq_ids: Sequence, positions: Sequence[int],
                   token_ids: Sequence[int]) -> None:
        tables = self.tables
        batch = tables.lookup(seq_ids, positions, unique=False)
        if len(token_ids) != len(batch):
            raise ValueError(f"{len(batch)} sequence ids but {len(token_ids)} token ids")
        rows = tables.rows
        R = tables.rows_of(batch)
        P, T = int_array(positions), int_array(token_ids)
        if P is None or T is None or len(R) and not (
                (P < rows.n[R]).all() and (rows.tok[R, P] == UNKNOWN_ID).all()
                and (tables.distinct(batch) or len(np.unique(R * rows.width + P)) == len(R))):
            P, T = self._check_set_tokens(seq_ids, batch, positions, token_ids)
        rows.tok[R, P] = T
        if tables.distinct(batch):
            rows.unknown[R] -= 1
        else:
            rows.unknown -= np.bincount(R, minlength=len(rows.unknown))
        due = np.flatnonzero(rows.computed[R] >= rows.key_at[R]).tolist()
        if due:
            self.keyer.key_computed([seq for seq in dict.fromkeys(batch[i] for i in due)
                                     if seq.host_table is None])

    @staticmethod
    def _check_set_tokens(seq_ids, batch: list[Seq], positions, token_ids):
        """Converted positions and token ids, or ValueError naming the first bad pair."""
        positions = [count_arg(p, "position") for p in positions]
        token_ids = [count_arg(t, "token id") for t in token_ids]
        seen = set()
        for sid, seq, p, t in zip(seq_ids, batch, positions, token_ids):
            if p >= seq.num_tokens:
                raise ValueError(f"position {p} is beyond the {seq.num_tokens} slots of "
                                 f"sequence {sid!r}")
            if seq.rows.tok[seq.row, p] != UNKNOWN_ID or (id(seq), p) in seen:
                raise ValueError(f"slot {p} of sequence {sid!r} does not hold an unknown token id "
                                 f"(or the pair repeats)")
            if t >= TOKEN_LIMIT:
                raise ValueError(f"token id {t} for sequence {sid!r} must be below 2**63")
            seen.add((id(seq), p))
        return np.array(positions, np.int64), np.array(token_ids, np.int64)
