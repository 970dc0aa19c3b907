"""What a finished step tells the host: how many slots are computed, and token ids that arrived late.

Full blocks get their prefix-cache keys once their KV is on device and every token id in them is
known: in ``mark_computed`` for the blocks it completes, and in ``set_tokens`` for computed blocks
that only waited for a token id.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged.kv.blocks.prefix_index import PrefixKeyer
from paged.kv.blocks.tables import TOKEN_LIMIT, Seq, SeqTables, count_arg

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
        if type(c) is int and seq.num_computed <= c < seq.key_at and c <= len(seq.tokens):
            seq.num_computed = c  # the decode fast path: no block completed
            return
        if seq.host_table is not None or type(c) is not int or not (
                seq.num_computed <= c <= len(seq.tokens)):
            c = self._check_computed(seq_id, seq, c)
        seq.num_computed = c
        self.keyer.key_computed((seq,))

    def mark_computed_many(self, seq_ids: Sequence, num_computed_tokens: Sequence[int]) -> None:
        batch = self.tables.lookup(seq_ids, num_computed_tokens)
        counts = num_computed_tokens
        keying = []  # sequences whose count reaches a block that may get its key
        if set(map(type, counts)) <= _INT:  # ints (checked in bulk), or nothing
            for seq, c in zip(batch, counts):  # validate everything first
                if not seq.num_computed <= c <= len(seq.tokens):
                    break
                if c >= seq.key_at:
                    if seq.host_table is not None:
                        break
                    keying.append(seq)
            else:
                for seq, c in zip(batch, counts):
                    seq.num_computed = c
                if keying:
                    self.keyer.key_computed(keying)
                return
        counts = [self._check_computed(s, q, n)  # raises, or converts int-like counts
                  for s, q, n in zip(seq_ids, batch, counts, strict=True)]
        for seq, c in zip(batch, counts, strict=True):
            seq.num_computed = c
        self.keyer.key_computed([seq for seq, c in zip(batch, counts) if c >= seq.key_at])

    def _check_computed(self, seq_id, seq: Seq, c) -> int:
        if seq.host_table is not None:
            self.tables.resident(seq_id)  # raises
        if type(c) is not int or not seq.num_computed <= c <= len(seq.tokens):
            c = count_arg(c, "num_computed_tokens")
            if not seq.num_computed <= c <= len(seq.tokens):
                raise ValueError(
                    f"num_computed_tokens={c} must be in [{seq.num_computed}, {len(seq.tokens)}] "
                    f"for sequence {seq_id!r} (use rollback to shrink)")
        return c

    def set_tokens(self, seq_ids: Sequence, positions: Sequence[int],
                   token_ids: Sequence[int]) -> None:
        batch = self.tables.lookup(seq_ids, positions, unique=False)
        if len(token_ids) != len(batch):
            raise ValueError(f"{len(batch)} sequence ids but {len(token_ids)} token ids")
        limit = TOKEN_LIMIT
        keying = []  # resident sequences with a full computed block not keyed yet
        i = 0
        try:  # a position beyond the slots raises IndexError at tokens[p]
            for i, (seq, p, t) in enumerate(zip(batch, positions, token_ids)):  # noqa: B007
                tokens = seq.tokens
                if (type(p) is int and p >= 0 and tokens[p] is None
                        and type(t) is int and 0 <= t < limit):
                    tokens[p] = t
                    seq.unknown -= 1
                    if seq.num_computed >= seq.key_at and seq.host_table is None:
                        keying.append(seq)
                    continue
                break
            else:
                if keying:
                    self.keyer.key_computed(keying)
                return
        except IndexError:
            pass
        for seq, p in zip(batch[:i], positions):  # undo, then check everything
            seq.tokens[p] = None
            seq.unknown += 1
        positions, token_ids = self._check_set_tokens(seq_ids, batch, positions, token_ids)
        for seq, p, t in zip(batch, positions, token_ids):
            seq.tokens[p] = t
            seq.unknown -= 1
        self.keyer.key_computed([seq for seq in batch if seq.host_table is None])

    @staticmethod
    def _check_set_tokens(seq_ids, batch: list[Seq], positions, token_ids):
        """Converted positions and token ids, or ValueError naming the first bad pair."""
        positions = [count_arg(p, "position") for p in positions]
        token_ids = [count_arg(t, "token id") for t in token_ids]
        seen = set()
        for sid, seq, p, t in zip(seq_ids, batch, positions, token_ids):
            if p >= len(seq.tokens):
                raise ValueError(f"position {p} is beyond the {len(seq.tokens)} slots of "
                                 f"sequence {sid!r}")
            if seq.tokens[p] is not None or (id(seq), p) in seen:
                raise ValueError(f"slot {p} of sequence {sid!r} does not hold an unknown token id "
                                 f"(or the pair repeats)")
            if t >= TOKEN_LIMIT:
                raise ValueError(f"token id {t} for sequence {sid!r} must be below 2**63")
            seen.add((id(seq), p))
        return positions, token_ids
