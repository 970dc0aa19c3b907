"""Per-sequence block tables: growth (the one decode-append path), copy-on-write, lookahead and
rollback, fork, free.

Each sequence has a block table, its token ids (``None`` for a slot whose token id is not known
yet: a lookahead slot without a draft, or a decode slot scheduled before its sampled token reached
the host), the number of slots whose KV is on device and the prefix-cache keys of its full computed
blocks. The token ids and the decode counters are one row of the tables' `TokenRows`
(`paged.kv.blocks.token_rows`, owned here): the decode append of a batch is array operations
over its rows. A writer never writes into a shared block (refcount > 1): appending into a shared partial
block takes a fresh block and returns a ``(src, dst)`` page copy. A block whose keyed content is
about to be rewritten in place leaves the index and changes version.

A sliding-window model recycles a sequence's leading blocks once they are behind every future
query's window (`paged.kv.blocks.window`): their table entries become ``NULL_PAGE`` and ``front``
counts them; everything here that walks a table starts at ``front``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from paged.kv.blocks.fence import StepFence
from paged.kv.blocks.pool import BlockPool
from paged.kv.blocks.prefix_index import BlockKey, PrefixCacheIndex
from paged.kv.blocks.token_rows import (  # (count_arg, token_list: imported from here too)
    FEW,
    NEVER,
    TOKEN_LIMIT,
    UNKNOWN_ID,
    TokenRows,
    count_arg,
    few_ids,
    id_array,
    masked_ids,
    token_list,
    unknown_as_none,
)
from paged.kv.paging import NULL_PAGE


class Seq:
    """One sequence's host state; its token ids and decode counters are row ``row`` of the
    tables' `TokenRows` (the properties below read and write it)."""

    __slots__ = ("dirty_tail", "front", "host_table", "keys", "nokey", "row", "rows", "salt",
                 "swap_in_step", "swap_out_step", "table")

    def __init__(self, rows: TokenRows, row: int, table: list[int], num_computed: int,
                 keys: list[BlockKey], salt: bytes):
        self.rows, self.row = rows, row
        self.table = table  # physical blocks; empty while swapped out
        rows.computed[row] = num_computed  # tokens whose KV is on device
        self.keys = keys  # prefix-cache keys of blocks 0 .. len(keys) - 1
        self.salt = salt
        self.host_table: list[int] | None = None  # host slots while swapped out
        self.dirty_tail = False  # tail block holds rolled-back slots that the next append rewrites
        self.swap_in_step = -1  # step that performs this sequence's latest swap-in copy
        self.swap_out_step = -1  # step that performs its latest swap-out copy
        self.front = 0  # leading table entries recycled (NULL_PAGE): behind the sliding window
        # Compacted by a KV policy (`paged.kv.blocks.compact`): its slots no longer hold one
        # position each, so none of its blocks is keyed from now on.
        self.nokey = False

    @property
    def num_tokens(self) -> int:
        """Slots (token ids, known or not)."""
        return int(self.rows.n[self.row])

    @property
    def tokens(self) -> list:
        """A copy of the token ids, ``None`` for a slot whose token id is not known yet."""
        return self.rows.ids(self.row)

    @property
    def num_computed(self) -> int:
        return int(self.rows.computed[self.row])

    @num_computed.setter
    def num_computed(self, c: int) -> None:
        self.rows.computed[self.row] = c

    @property
    def room(self) -> int | None:
        """The exact number of free slots in the tail block when that block is known to be
        exclusive, unkeyed and clean (0: the tail is full, the next token takes a fresh block),
        or None when not known (fork, rollback, swap, debug): the decode fast path's state."""
        rows, r = self.rows, self.row
        return -int(rows.n[r]) % rows.block_size if rows.fast[r] else None

    @room.setter
    def room(self, room: int | None) -> None:
        """None: off the fast path; else the tail's free slots (``-num_tokens % block_size``)."""
        self.rows.fast[self.row] = room is not None

    @property
    def key_at(self) -> int:
        """mark_computed may skip keying below this count; -1 forces the checked path."""
        return int(self.rows.key_at[self.row])

    @key_at.setter
    def key_at(self, k: int) -> None:
        self.rows.key_at[self.row] = k

    @property
    def unknown(self) -> int:
        """Slots whose token id is not known yet."""
        return int(self.rows.unknown[self.row])


class SeqTables:
    """The sequences and their block tables.

    Args:
      pool, fence, index: the block pool, step fence and prefix-cache index.
      block_size: tokens per block.
      enable_prefix_caching: whether full blocks get keyed.
      debug: keep every sequence off the decode fast paths (``room``/``key_at`` unknown).
    """

    def __init__(self, pool: BlockPool, fence: StepFence, index: PrefixCacheIndex,
                 block_size: int, *, enable_prefix_caching: bool, debug: bool):
        self.pool, self.fence, self.index = pool, fence, index
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.debug = debug
        self.seqs: dict[Hashable, Seq] = {}
        self.rows = TokenRows(block_size)  # every sequence's token ids and decode counters
        # The last two distinct batches (decode appends, the readback's marks): (a copy of
        # their ids, their Seqs, their rows), newest first; forgotten when seqs changes.
        self.batches: list[tuple[list, list[Seq], np.ndarray]] = []
        self.cow_copies = 0
        self.peak_blocks = 0  # most live blocks a sequence held when it left (see max_blocks)

    # --- lookups ---------------------------------------------------------------------------
    def get(self, seq_id) -> Seq:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        return seq

    def resident(self, seq_id) -> Seq:
        seq = self.get(seq_id)
        if seq.host_table is not None:
            raise ValueError(f"sequence {seq_id!r} is swapped out")
        return seq

    def lookup(self, seq_ids: Sequence, values: Sequence, *, unique: bool = True) -> list[Seq]:
        """The Seqs of ``seq_ids`` (one per value); a remembered batch's when the ids repeat it.

        Raises:
          ValueError: unknown ids, lengths that differ, or repeated ids when ``unique``.
        """
        for entry in self.batches:  # steady decoding repeats its batches: skip the lookups
            if (type(seq_ids) is list and entry[0] == seq_ids
                    and len(values) == len(seq_ids)):
                return entry[1]
        try:
            batch = list(map(self.seqs.__getitem__, seq_ids))
        except (KeyError, TypeError):
            for s in seq_ids:
                self.get(s)  # raises for the first unknown id
            raise
        if len(batch) != len(values):
            raise ValueError(f"{len(batch)} sequence ids but {len(values)} values")
        if len(set(batch)) != len(batch):  # a Seq hashes by identity
            if unique:
                raise ValueError(f"repeated sequence ids in {seq_ids!r}")
        elif type(seq_ids) is list:
            rows = np.fromiter([seq.row for seq in batch], np.intp, len(batch))
            self.batches = [(list(seq_ids), batch, rows)] + self.batches[:1]
        return batch

    def rows_of(self, batch: list[Seq]) -> np.ndarray:
        """The token rows of ``batch`` (a remembered batch's, kept)."""
        for entry in self.batches:
            if entry[1] is batch:
                return entry[2]
        return np.fromiter([seq.row for seq in batch], np.intp, len(batch))

    def distinct(self, batch: list[Seq]) -> bool:
        """Whether ``batch`` is known to hold distinct sequences (a remembered batch)."""
        return any(entry[1] is batch for entry in self.batches)

    # --- creation and removal --------------------------------------------------------------
    def add(self, seq_id, table: list[int], tokens: list[int], hits: list[tuple[int, BlockKey]],
            salt: bytes, num_computed: int | None = None) -> Seq:
        """Creates ``seq_id`` over ``table`` (``tokens``: validated ids, none unknown) whose first
        ``len(hits)`` blocks are computed hits (``num_computed``: more computed tokens, in blocks
        loaded from the host tier, keyed once their copy ran)."""
        computed = len(hits) * self.block_size if num_computed is None else num_computed
        rows = self.rows
        r = rows.take()
        rows.extend(r, tokens, known=True)  # (validated: no unknown id)
        seq = self.seqs[seq_id] = Seq(rows, r, table, computed, [k for _, k in hits], salt)
        self.batches = []
        self.fast_state(seq)  # the tail block is fresh
        return seq

    def fork(self, parent_seq_id, child_seq_id) -> None:
        parent = self.resident(parent_seq_id)
        if child_seq_id in self.seqs:
            raise ValueError(f"sequence {child_seq_id!r} already exists")
        if parent.num_computed != parent.num_tokens:
            raise ValueError(
                f"cannot fork {parent_seq_id!r}: {parent.num_tokens - parent.num_computed} of its "
                f"slots are not computed yet; fork after the step that writes them")
        rows = self.rows
        r = rows.take()
        rows.copy_row(parent.row, r)  # token ids, counts (unknown slots included)
        child = Seq(rows, r, list(parent.table), parent.num_computed, list(parent.keys),
                    parent.salt)
        child.room = None
        child.dirty_tail = parent.dirty_tail
        child.swap_in_step = parent.swap_in_step
        child.front = parent.front
        child.nokey = parent.nokey
        parent.room = None  # the tail block is shared now
        self.set_key_at(child)
        rc = self.pool.rc
        for b in child.table[child.front:]:
            rc[b] += 1
        self.seqs[child_seq_id] = child
        self.batches = []

    def remove(self, seq_id) -> None:
        """Drops ``seq_id``: its blocks tail first (tail blocks are evicted first) or host slots."""
        seq = self.get(seq_id)
        del self.seqs[seq_id]
        self.batches = []
        self.note_peak(seq)
        self.rows.release(seq.row)
        if seq.host_table is not None:
            self.fence.release_host(seq.host_table)
        else:
            self.fence.release(reversed(seq.table[seq.front:]))

    def note_peak(self, seq: Seq) -> None:
        """Counts ``seq``'s live blocks (device or host) into ``peak_blocks``."""
        held = len(seq.host_table) if seq.host_table is not None else len(seq.table) - seq.front
        if held > self.peak_blocks:
            self.peak_blocks = held

    def max_blocks(self) -> int:
        """The most live blocks any sequence held at once since construction (the sequences
        alive now included), as far as tables were seen: when a sequence left, was swapped out
        or rolled back, or was recycled (`paged.kv.blocks.window`)."""
        for seq in self.seqs.values():
            self.note_peak(seq)
        return self.peak_blocks

    def block_usage(self, skip=frozenset()) -> list[tuple[int, int]]:
        """(refcount, most slots any sequence fills) of every used block, by block id; blocks
        only the sequences in ``skip`` hold are left out."""
        filled: dict[int, int] = {}
        B = self.block_size
        for seq_id, seq in self.seqs.items():
            if seq_id in skip:
                continue
            table = seq.table
            if not table:
                continue
            for b in table[seq.front:-1]:
                filled[b] = B
            last = table[-1]
            n = seq.num_tokens - (len(table) - 1) * B
            if filled.get(last, 0) < n:
                filled[last] = n
        return [(self.pool.rc[b], filled[b]) for b in sorted(filled)]

    def blocks_only_in(self, seq_ids: frozenset) -> set[int]:
        """The blocks that the sequences ``seq_ids`` hold and no other sequence does."""
        mine, others = set(), set()
        for i, seq in self.seqs.items():
            (mine if i in seq_ids else others).update(seq.table[seq.front:])
        return mine - others

    # --- fast-path state -------------------------------------------------------------------
    def fast_state(self, seq: Seq) -> None:
        """Sets the decode fast-path state after the tail block was made exclusive and clean."""
        seq.room = None if self.debug else -seq.num_tokens % self.block_size
        self.set_key_at(seq)

    def set_key_at(self, seq: Seq) -> None:
        if self.debug or seq.host_table is not None:
            seq.key_at = -1
        elif self.caching and not seq.nokey:
            seq.key_at = (len(seq.keys) + 1) * self.block_size
        else:
            seq.key_at = NEVER

    # --- growth ----------------------------------------------------------------------------
    def grow_need(self, seq: Seq, m: int) -> int:
        """Fresh blocks ``m`` more slots take, a copy-on-write of a shared tail included."""
        if m == 0:
            return 0
        n = seq.num_tokens
        cow = n % self.block_size != 0 and self.pool.rc[seq.table[-1]] > 1
        return -(-(n + m) // self.block_size) - len(seq.table) + cow

    def grow(self, seq: Seq, new: list) -> list[tuple[int, int]] | None:
        """Appends the (validated) slots ``new`` to a resident ``seq``; CoW pairs or ``None``."""
        m = len(new)
        if m == 0:
            return []
        pool = self.pool
        need = self.grow_need(seq, m)
        if need > len(pool.free) + len(pool.lru):
            return None
        fresh = pool.take(need) if need else []  # take(0) changes nothing
        pairs = []
        if seq.num_tokens % self.block_size:
            last = seq.table[-1]
            key = self.index.key[last]
            if pool.rc[last] > 1:  # copy-on-write: never write into a shared block
                dst = fresh.pop(0)
                pool.rc[last] -= 1
                self.fence.hold_for_copy((last, dst))
                self.fence.cow_src[dst] = last
                seq.table[-1] = dst
                pairs.append((last, dst))
                self.cow_copies += 1
            elif key is not None or seq.dirty_tail:
                # Rewriting slots in place: the keyed content (if any) dies with it.
                if key is not None:
                    self.index.remove(last, key.digest)
                pool.version[last] += 1
        seq.dirty_tail = False
        seq.table.extend(fresh)
        self.rows.extend(seq.row, new)
        self.fast_state(seq)
        return pairs

    def append_slots(self, seq_id, new_token_ids: Sequence) -> list[tuple[int, int]] | None:
        """`BlockManager.append_slots` (reports evicted blocks to ``on_free`` itself)."""
        try:
            seq = self.seqs[seq_id]
        except (KeyError, TypeError):
            seq = self.get(seq_id)  # raises
        if type(new_token_ids) is list and len(new_token_ids) == 1:
            t, room = new_token_ids[0], seq.room
            if room is not None and (t is None or type(t) is int and 0 <= t < TOKEN_LIMIT):
                return self._append_one(seq, t, room)
            return self.append_decode((seq,), new_token_ids)
        if seq.host_table is not None:
            self.resident(seq_id)  # raises
        pairs = self.grow(seq, token_list(new_token_ids, "new_token_ids", unknown_ok=True))
        if self.pool.died:
            self.pool.flush()
        return pairs

    def _append_one(self, seq: Seq, t: int | None, room: int) -> list | None:
        """``append_decode`` of one sequence whose tail ``room`` is known and one valid token id
        (the single-sequence fast path of ``append_slots``)."""
        rows, r = self.rows, seq.row
        if not room:  # the tail is full: a fresh block
            pool = self.pool
            if not (pool.free or pool.lru):
                return None
            seq.table.append(pool.take(1)[0])
            if pool.died:  # an evicted cached block: report it now
                pool.flush()
        n = int(rows.n[r])
        if n >= rows.width:
            rows.fit(n + 1)
        if t is None:
            rows.tok[r, n] = UNKNOWN_ID
            rows.unknown[r] += 1
        else:
            rows.tok[r, n] = t
        rows.n[r] = n + 1
        return []

    def append_decode(self, batch: Sequence[Seq], token_ids: Sequence, unknown=None
                      ) -> list[tuple[int, int]] | None:
        """The decode append: one slot per sequence of ``batch`` (distinct; as many as
        ``token_ids``: ints, ``None`` for unknown, or an integer ndarray), all or nothing.

        Array operations over the batch's rows (a Python pass of scalar writes for up to
        ``FEW`` rows: the same state, cheaper at that size) when every tail's ``room`` is known
        and every token id valid; the checked path otherwise. ``unknown``: a bool mask of the slots whose
        token id is not known yet (``token_ids`` an integer ndarray; its values there ignored).
        """
        few = few_ids(token_ids, unknown, len(batch)) if len(batch) <= FEW else None
        if few is None:  # the array path (or the checked path)
            T = id_array(token_ids) if unknown is None else masked_ids(token_ids, unknown)
        rows = self.rows
        R = self.rows_of(batch)
        if (few is None and (T is None or len(T) != len(batch))  # an id needs checking
                or not (rows.fast[R].all() if few is None else all(rows.fast[R].tolist()))):
            return self._append_decode_checked(batch, token_ids if unknown is None else
                                               unknown_as_none(token_ids, unknown))
        B = self.block_size
        if few is None:
            n = rows.n[R]
            start = np.flatnonzero(n % B == 0).tolist()  # full tails: these take a fresh block
        else:
            ns = rows.n[R].tolist()
            start = [i for i, k in enumerate(ns) if not k % B]
        pool = self.pool
        if len(start) > len(pool.free) + len(pool.lru):
            return None
        if few is None:  # (``unknown`` or a list: some token ids may be unknown)
            rows.put_each(R, n, T, unknown is not None or not isinstance(token_ids, np.ndarray))
        else:
            rows.put_few(R, ns, *few)
        if start:
            for i, b in zip(start, pool.take(len(start))):
                batch[i].table.append(b)
            if pool.died:  # evicted cached blocks: report them now
                pool.flush()
        return []

    def _append_decode_checked(self, batch: Sequence[Seq], token_ids: Sequence
                               ) -> list[tuple[int, int]] | None:
        """``append_decode`` for any state: validate and count every block first, then grow."""
        token_ids = token_list(token_ids, "token_ids", unknown_ok=True)
        if len(token_ids) != len(batch):
            raise ValueError(f"{len(batch)} sequences but {len(token_ids)} token ids")
        B, rc = self.block_size, self.pool.rc
        need = 0
        copied: dict[int, int] = {}  # shared tail -> sharers in this batch that copy it first
        for seq in batch:
            if seq.host_table is not None:
                raise ValueError("a sequence of the decode batch is swapped out")
            if seq.num_tokens % B:
                tail = seq.table[-1]
                k = copied.get(tail, 0)
                if rc[tail] - k > 1:  # the last sharer to write keeps the block
                    need += 1
                    copied[tail] = k + 1
            else:
                need += 1
        if need > self.pool.num_allocatable:
            return None
        pairs = []
        for seq, t in zip(batch, token_ids):
            pairs += self.grow(seq, [t])
        if self.pool.died:
            self.pool.flush()
        return pairs

    # --- lookahead and rollback ------------------------------------------------------------
    def reserve_lookahead(self, seq_id, k: int, token_ids: Sequence[int] | None
                          ) -> list[tuple[int, int]] | None:
        seq = self.resident(seq_id)
        k = count_arg(k, "k")
        if token_ids is None:
            return self.grow(seq, [None] * k)
        new = token_list(token_ids, "token_ids")
        if len(new) != k:
            raise ValueError(f"len(token_ids)={len(new)} != k={k}")
        return self.grow(seq, new)

    def rollback(self, seq_id, r: int) -> None:
        seq = self.resident(seq_id)
        r = count_arg(r, "r")
        n = seq.num_tokens
        if r > n:
            raise ValueError(f"cannot roll back r={r} of {n} slots of sequence {seq_id!r}")
        if r == 0:
            return
        B = self.block_size
        new_n = n - r
        keep = -(-new_n // B)
        self.note_peak(seq)
        seq.front = min(seq.front, keep)  # (rollback never reaches behind a window in practice)
        dropped = [b for b in seq.table[keep:] if b != NULL_PAGE]
        del seq.table[keep:]
        self.rows.truncate(seq.row, new_n)
        seq.num_computed = min(seq.num_computed, new_n)
        del seq.keys[new_n // B:]
        seq.dirty_tail = new_n % B != 0
        seq.room = None
        self.set_key_at(seq)
        self.fence.release(reversed(dropped))
