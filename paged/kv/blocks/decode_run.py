"""Steady decode steps of one batch in one call (``BlockManager.run_decode_steps``).

``m`` serial decode steps of the same sequences, each step appending one known token id to every
sequence, launching and completing (``begin_step`` / ``step_completed``), then marking computed
the sequences whose new slot completed a block (the engine's readback hears of a decode only
then): the state afterwards is the state of ``m`` rounds of ``append_decode_slots``,
``begin_step``, ``step_completed`` and ``mark_computed_many`` of those sequences. The per-step work
is only where something happens: a step that starts blocks takes them from the pool (one
``take``, in row order, as the decode append does), a step that completes blocks keys them, and
while blocks wait in quarantine every step completes on its own (their release order is the free
queue's order). Token ids are appended up front: nothing reads a slot before the step that
completes its block keys it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paged.kv.blocks.fence import StepFence
from paged.kv.blocks.progress import Progress
from paged.kv.blocks.tables import TOKEN_LIMIT, Seq, SeqTables
from paged.kv.blocks.token_rows import DTYPE

_INT = {int}


def run(tables: SeqTables, progress: Progress, fence: StepFence, seq_ids: Sequence,
        token_ids: Sequence) -> bool:
    """Checks the call, then runs the steps; ``False`` (nothing changed) when the pool cannot
    supply them.

    Raises:
      ValueError: unknown, swapped-out or repeated sequence ids; rows of different lengths or bad
        (or unknown) token ids; a shared partly filled tail (its first append would copy it); all
        before any state change.
    """
    batch, rows = check_run(tables, seq_ids, token_ids)
    R = tables.rows_of(batch)  # their token rows
    n0 = tables.rows.n[R].tolist()  # their lengths, read once
    need = blocks_needed(tables, batch, rows.shape[1], R, n0)
    if need is None:
        raise ValueError("a sequence's partly filled tail block is shared: its next append "
                         "copies it (use append_decode_slots)")
    if need > tables.pool.num_allocatable:
        return False
    run_decode_steps(tables, progress, fence, batch, rows, R, n0)
    return True


def check_run(tables: SeqTables, seq_ids: Sequence, token_ids: Sequence
              ) -> tuple[list[Seq], np.ndarray]:
    """The Seqs and the token ids as an int64 ``[len(seq_ids), m]`` array, or ValueError (no
    state touched)."""
    if not isinstance(seq_ids, list | tuple):
        raise ValueError(f"seq_ids must be a list of sequence ids, got {type(seq_ids).__name__}")
    # A repeated batch is remembered (its rows too); raises for unknown or repeated ids.
    batch = tables.lookup(seq_ids, seq_ids)
    if any(seq.host_table is not None for seq in batch):
        for s in seq_ids:
            tables.resident(s)  # raises for the first swapped-out id
    if isinstance(token_ids, np.ndarray) and token_ids.ndim == 2 \
            and token_ids.dtype.kind in "iu" and token_ids.shape[0] == len(batch):
        # (checked in bulk; a signed 64-bit id is below 2**63, an unsigned one is not negative)
        if token_ids.size and (token_ids.min() < 0 if token_ids.dtype.kind == "i"
                               else token_ids.max() >= TOKEN_LIMIT):
            raise ValueError("token ids must be ints in [0, 2**63)")
        return batch, token_ids.astype(DTYPE, copy=False)
    try:
        rows = [list(r) for r in token_ids]
    except TypeError:
        raise ValueError("token_ids must be one sequence of token ids per sequence id") from None
    if len(rows) != len(batch):
        raise ValueError(f"{len(batch)} sequence ids but {len(rows)} rows of token ids")
    m = len(rows[0]) if rows else 0
    for sid, row in zip(seq_ids, rows):
        if len(row) != m:
            raise ValueError(f"sequence {sid!r} has {len(row)} token ids, the first has {m}: "
                             "every sequence decodes the same number of steps")
        if row and not (set(map(type, row)) <= _INT and min(row) >= 0 and max(row) < TOKEN_LIMIT):
            raise ValueError(f"token ids {row!r} of sequence {sid!r} must be ints in [0, 2**63) "
                             "(a decode run appends known token ids)")
    return batch, np.array(rows, DTYPE).reshape(len(rows), m)


def blocks_needed(tables: SeqTables, batch: list[Seq], m: int, R=None, n0=None) -> int | None:
    """Fresh blocks ``m`` decode steps take, or ``None`` when some tail is shared and partly
    filled (its first append would copy it: not a steady decode). ``R``: the batch's rows,
    ``n0``: their lengths (a list)."""
    B, rc = tables.block_size, tables.pool.rc
    need = 0
    if n0 is None:
        n0 = tables.rows.n[tables.rows_of(batch) if R is None else R].tolist()
    for seq, n in zip(batch, n0):
        room = -n % B
        if room and rc[seq.table[-1]] > 1:
            return None
        if m > room:
            need += -(-(m - room) // B)
    return need


def run_decode_steps(tables: SeqTables, progress: Progress, fence: StepFence, batch: list[Seq],
                     ids: np.ndarray, R=None, n0=None) -> None:
    """Runs the steps (module docstring); the caller checked the arguments and the pool.
    ``ids``: the token ids, one row per sequence of ``batch``; ``R``: their token rows, ``n0``:
    their lengths (a list).

    The rows' counters are read once (a gather each), the steps' bookkeeping is done on Python
    lists, and the counters are written once at the end (a scatter each)."""
    m = ids.shape[1]
    if m == 0:
        return
    rows = tables.rows
    R = tables.rows_of(batch) if R is None else R
    if not all(rows.fast[R].tolist()):  # off the fast path (debug, fork, rollback, swap)
        _stepwise(tables, progress, fence, batch, ids)
        return
    B = tables.block_size
    pool, keyer = tables.pool, progress.keyer
    if n0 is None:
        n0 = rows.n[R].tolist()
    starts: dict[int, list[int]] = {}  # step -> rows whose slot starts a block (row order)
    fills: dict[int, list[int]] = {}  # step -> rows whose slot completes a block
    need = 0
    for r, n in enumerate(n0):
        room = -n % B
        for j in range(room, m, B):
            starts.setdefault(j, []).append(r)
            need += 1
        for j in range((room - 1) % B, m, B):
            fills.setdefault(j, []).append(r)
    if n0 and max(n0) + m > rows.width:
        rows.fit(max(n0) + m)
    n = rows.n[R]
    rows.tok[R[:, None], n[:, None] + np.arange(m)] = ids
    rows.n[R] = n + m
    filled = _Filled(keyer, batch, R, n0, rows)
    if not (fence.held or fence.host_held) and fence.copy_step <= fence.last_completed \
            and len(pool.free) >= need:
        _run_quiet(fence, pool, filled, batch, m, starts, fills, need)
        filled.counts_to(rows, R)
        return
    owed = 0  # steps up to here not begun / completed yet (nothing happened in them)
    j = 0
    for e in sorted(starts.keys() | fills.keys()):
        owed += e - j
        s = starts.get(e)
        if s is not None:  # step e's schedule takes its blocks after step e - 1 completed
            _steps(fence, pool, owed)
            owed = 0
            for r, b in zip(s, pool.take(len(s))):
                batch[r].table.append(b)
            if pool.died:
                pool.flush()
        owed += 1
        f = fills.get(e)
        if f is not None:  # its readback keys the blocks it filled, after it completed
            _steps(fence, pool, owed)
            owed = 0
            filled.steps({e: f})
        j = e + 1
    _steps(fence, pool, owed + m - j)
    filled.counts_to(rows, R)


def _run_quiet(fence: StepFence, pool, filled: _Filled, batch: list[Seq], m: int, starts: dict,
               fills: dict, need: int) -> None:
    """The steps when nothing waits on a step (no quarantine, no pending copy) and the free
    queue holds every block they start: each step's ``take`` pops the queue's head and nothing
    else touches the queue, so one ``take`` of all of them, dealt out in step order, leaves the
    same tables; keying reads no step id (no copy pends), so only the ids move, once, and the
    readbacks are keyed in one call."""
    if need:
        taken = iter(pool.take(need))
        for e in sorted(starts):
            for r in starts[e]:
                batch[r].table.append(next(taken))
        if pool.died:
            pool.flush()
    filled.steps(fills)  # each step's readback keys in step order (equal keys: first wins)
    _steps(fence, pool, m)


class _Filled:
    """The readbacks of a run's steps: the rows whose block a step filled get their computed
    count and, past their keying threshold, their keys (as ``mark_computed_many`` would). The
    computed counts and thresholds are read from the rows once, kept as lists through the run
    and written back once at its end (nothing reads them meanwhile: keying is handed them)."""

    def __init__(self, keyer, batch: list[Seq], R: np.ndarray, n0: list[int], rows):
        self.keyer, self.batch, self.n0 = keyer, batch, n0
        self.rs = R.tolist()
        self.computed = rows.computed[R].tolist()
        self.key_at = rows.key_at[R].tolist()

    def steps(self, fills: dict[int, list[int]]) -> None:
        """The readbacks of steps ``fills`` (step -> batch indices that filled a block then),
        in step order."""
        n0, computed = self.n0, self.computed
        events = []
        for e in sorted(fills):
            for r in fills[e]:
                c = computed[r] = n0[r] + e + 1
                events.append((r, c))
        self.keyer.key_run(self.batch, self.rs, events, self.key_at)

    def counts_to(self, rows, R: np.ndarray) -> None:
        """Writes the computed counts and keying thresholds back to the rows."""
        rows.computed[R] = self.computed
        if not self.keyer.debug:  # (never here: debug rows are off the fast path)
            rows.key_at[R] = self.key_at


def _steps(fence: StepFence, pool, k: int) -> None:
    """``k`` steps begun and completed, as ``begin_step`` / ``step_completed`` pairs."""
    while k > 0 and (fence.held or fence.host_held):  # releases happen step by step
        fence.complete(fence.begin())
        if pool.died:
            pool.flush()
        k -= 1
    if k > 0:  # nothing waits on a step (and nothing is freed meanwhile): only the ids move
        fence.last_begun += k
        fence.cow_src.clear()
        fence.complete(fence.last_begun)


def _stepwise(tables: SeqTables, progress: Progress, fence: StepFence, batch: list[Seq],
              ids: np.ndarray) -> None:
    """The same steps through the per-step calls (sequences whose fast-path state is unknown)."""
    B = tables.block_size
    pool = tables.pool
    for j in range(ids.shape[1]):
        if tables.append_decode(batch, ids[:, j]) != []:
            raise AssertionError("a checked decode run needed blocks or copies")
        _steps(fence, pool, 1)
        full = [seq for seq in batch if seq.num_tokens % B == 0]
        if full:
            for seq in full:
                seq.num_computed = seq.num_tokens
            progress.keyer.key_computed(full)
