"""The block manager's token log: every sequence's slots as one row of one int64 array.

`SeqTables` owns one `TokenRows` (the only copy of the block manager's token ids; the engine's
`paged.step.input_batch.InputBatch` keeps its own int32 rows by position, which a KV policy's
compaction makes differ from slots). A `paged.kv.blocks.tables.Seq` holds a row index; its slot
``i``'s token id is ``tok[row, i]`` for ``i < n[row]`` (``UNKNOWN_ID = -1``: not known yet, a
lookahead slot without a draft or a decode slot whose sampled token has not reached the host).
The per-row counters the decode step reads live beside it as arrays, so a batch of rows is
appended, counted and keyed with array operations: ``computed`` (slots whose KV is on device),
``fast`` (the tail block is known to be exclusive, unkeyed and clean: the next ``-n % block_size``
slots go into it in place, then a fresh block; the decode fast path), ``key_at``
(``mark_computed`` has nothing to key below it; -1 forces the checked path) and ``unknown``
(slots holding ``UNKNOWN_ID``). A block's key bytes are ``tok[row, a:b].tobytes()``: int64
little-endian, the bytes ``paged.kv.blocks.prefix_index.pack_tokens`` makes.

Rows and width grow by doubling; a released row is reused by the next sequence.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

UNKNOWN_ID = -1  # a slot whose token id is not known yet (``None`` in the public API)
DTYPE = np.dtype("<i8")  # int64 little-endian: the key bytes
TOKEN_LIMIT = 2**63  # token ids are hashed as int64
_INT = {int}
NEVER = 2**63 - 1  # a ``key_at`` no count reaches (prefix caching off, or a compacted sequence)
FEW = 16  # decode batches up to this size take the Python pass (`few_ids`, `TokenRows.put_few`)


class TokenRows:
    """Rows of token ids and their counters (module docstring)."""

    def __init__(self, block_size: int, capacity: int = 16, width: int = 256):
        self.block_size = block_size
        self.tok = np.full((capacity, width), UNKNOWN_ID, DTYPE)
        self.n = np.zeros(capacity, np.int64)
        self.computed = np.zeros(capacity, np.int64)
        self.fast = np.zeros(capacity, bool)
        self.key_at = np.full(capacity, -1, np.int64)
        self.unknown = np.zeros(capacity, np.int64)
        self.free = list(range(capacity - 1, -1, -1))  # a stack: the lowest row first

    @property
    def capacity(self) -> int:
        return len(self.n)

    @property
    def width(self) -> int:
        return self.tok.shape[1]

    def take(self) -> int:
        """A fresh row (length 0, counters cleared)."""
        if not self.free:
            self._grow_rows()
        return self.free.pop()

    def release(self, r: int) -> None:
        self.n[r] = self.computed[r] = self.unknown[r] = 0
        self.fast[r] = False
        self.key_at[r] = -1
        self.free.append(r)

    def _grow_rows(self) -> None:
        cap = self.capacity
        for name in ("tok", "n", "computed", "fast", "key_at", "unknown"):
            a = getattr(self, name)
            b = np.full((2 * cap,) + a.shape[1:], UNKNOWN_ID if name == "tok" else 0, a.dtype)
            b[:cap] = a
            setattr(self, name, b)
        self.key_at[cap:] = -1
        self.free.extend(range(2 * cap - 1, cap - 1, -1))

    def fit(self, length: int) -> None:
        """Makes rows at least ``length`` wide (doubling)."""
        w = self.width
        if length > w:
            while w < length:
                w *= 2
            tok = np.full((self.capacity, w), UNKNOWN_ID, DTYPE)
            tok[:, :self.width] = self.tok
            self.tok = tok

    # --- per-row writes (validated ids: ints in [0, 2**63) or None) ------------------------
    def extend(self, r: int, ids: list, *, known: bool = False) -> None:
        """Appends ``ids`` (``None`` = unknown; ``known``: none is, not scanned) to row ``r``."""
        n = int(self.n[r])
        m = len(ids)
        if n + m > self.width:
            self.fit(n + m)
        if not known and None in ids:
            self.unknown[r] += ids.count(None)
            ids = [UNKNOWN_ID if t is None else t for t in ids]
        self.tok[r, n:n + m] = np.fromiter(ids, DTYPE, m)
        self.n[r] = n + m

    def put_each(self, R: np.ndarray, n: np.ndarray, T: np.ndarray, mixed: bool) -> None:
        """Appends ``T[i]`` to row ``R[i]`` (distinct rows of lengths ``n``; ``mixed``: ``T`` may
        hold ``UNKNOWN_ID``): the decode append's array path."""
        if len(n) and n.max() >= self.width:
            self.fit(int(n.max()) + 1)
        self.tok[R, n] = T
        self.n[R] = n + 1
        if mixed:  # some token ids may be unknown: count them
            self.unknown[R] += T == UNKNOWN_ID

    def put_few(self, R: np.ndarray, ns: list, ids: list, unknown: list | None) -> None:
        """`put_each` of a few rows by scalar writes (``ns``, ``ids`` lists; ``unknown``: which
        ids are ``UNKNOWN_ID``, or None when none is): the same state, cheaper at this size."""
        if ns and max(ns) >= self.width:
            self.fit(max(ns) + 1)
        tok, n = self.tok, self.n
        for r, k, t in zip(R.tolist(), ns, ids):
            tok[r, k] = t
            n[r] = k + 1
        if unknown is not None:
            self.unknown[R] += unknown

    def truncate(self, r: int, n: int) -> None:
        """Drops row ``r``'s slots from ``n`` on (recounting its unknown slots)."""
        self.n[r] = n
        if self.unknown[r]:
            self.unknown[r] = int((self.tok[r, :n] == UNKNOWN_ID).sum())

    def copy_row(self, src: int, dst: int) -> None:
        n = int(self.n[src])
        self.tok[dst, :n] = self.tok[src, :n]
        for a in (self.n, self.computed, self.fast, self.key_at, self.unknown):
            a[dst] = a[src]

    # --- reads ---------------------------------------------------------------------------
    def ids(self, r: int, start: int = 0, end: int | None = None) -> list:
        """Row ``r``'s token ids ``start .. end`` (default: all) as a list, ``None`` = unknown."""
        n = int(self.n[r])
        end = n if end is None else min(end, n)
        out = self.tok[r, start:end].tolist()
        if self.unknown[r] and UNKNOWN_ID in out:
            out = [None if t == UNKNOWN_ID else t for t in out]
        return out


def int_array(values) -> np.ndarray | None:
    """Non-negative int64 values below 2**63 of a list of ints or a 1-D integer ndarray (passed
    through without a Python loop), or ``None`` when one needs the checked path."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            return None
        if values.size and (values.min() < 0 if values.dtype.kind == "i"
                            else values.max() >= TOKEN_LIMIT):
            return None
        return values.astype(DTYPE, copy=False)
    if type(values) is not list:
        try:
            values = list(values)
        except TypeError:
            return None
    if not values:
        return np.zeros(0, DTYPE)
    a = np.array(values)  # int64 only when every value is an int (or bool) below 2**63
    if a.dtype is DTYPE and a.ndim == 1:
        return None if a.min() < 0 else a
    return None


def id_array(token_ids) -> np.ndarray | None:
    """``token_ids`` as an int64 array (``UNKNOWN_ID`` for ``None``), or ``None`` when some value
    needs the checked path (not an int, negative, 2**63 or more; a ``-1`` is never accepted as
    unknown: ``None`` is). An integer ndarray passes through without a Python loop."""
    if isinstance(token_ids, np.ndarray):
        return int_array(token_ids)
    if type(token_ids) is not list:
        try:
            token_ids = list(token_ids)
        except TypeError:
            return None
    m = len(token_ids)
    if m and token_ids[0] is None and token_ids.count(None) == m:  # all unknown
        return np.full(m, UNKNOWN_ID, DTYPE)
    a = np.array(token_ids)  # int64 only when every value is an int (or bool) below 2**63
    if a.dtype is DTYPE and a.ndim == 1:
        return None if m and a.min() < 0 else a
    if a.dtype.kind != "O" or a.ndim != 1:
        return None
    unknown = token_ids.count(None)
    if not unknown:
        return None
    a = np.array([UNKNOWN_ID if t is None else t for t in token_ids])
    if a.dtype is not DTYPE or a.min() < UNKNOWN_ID or np.count_nonzero(a == UNKNOWN_ID) != unknown:
        return None  # a value that is no int, a negative id, or a -1 that was no None
    return a


def few_ids(token_ids, unknown, m: int) -> tuple[list, list | None] | None:
    """A small decode batch's ``m`` token ids (a list, ``None`` for unknown, or an integer
    ndarray with an optional bool mask ``unknown`` as in `masked_ids`) as a list of ints
    (``UNKNOWN_ID`` for unknown) and the unknown flags (None when none is unknown), or ``None``
    when something needs the array or the checked path (a bad id, a length that differs)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            return None
        ids = token_ids.tolist()
    elif type(token_ids) is list:
        ids = token_ids
    else:
        return None
    if len(ids) != m:
        return None
    if unknown is not None:
        u = np.asarray(unknown, bool)
        if u.shape != (m,):
            return None
        flags = u.tolist()
        known = [t for t, f in zip(ids, flags) if not f]
    elif None in ids:
        flags = [t is None for t in ids]
        known = [t for t in ids if t is not None]
    else:
        flags, known = None, ids
    if known and not (set(map(type, known)) <= _INT and min(known) >= 0
                      and max(known) < TOKEN_LIMIT):
        return None
    if flags is None:
        return ids, None
    return [UNKNOWN_ID if f else t for t, f in zip(ids, flags)], flags


def masked_ids(token_ids, unknown) -> np.ndarray | None:
    """``id_array`` of an integer ndarray whose ``unknown`` (a bool mask) entries are not known
    yet (their values ignored), or ``None`` when a known value needs the checked path."""
    unknown = np.asarray(unknown, bool)
    if not (isinstance(token_ids, np.ndarray) and token_ids.dtype.kind in "iu"
            and token_ids.shape == unknown.shape and token_ids.ndim == 1):
        return None
    a = token_ids.astype(DTYPE)  # a copy
    a[unknown] = 0
    if a.size and (a.min() < 0 or token_ids.dtype.kind == "u" and token_ids.max() >= 2**63):
        return None
    a[unknown] = UNKNOWN_ID
    return a


def unknown_as_none(token_ids, unknown) -> list:
    """``token_ids`` as a list with ``None`` where ``unknown`` is true (the public form; all of
    them when ``unknown`` is None)."""
    if unknown is None:
        return list(token_ids)
    return [None if u else t for t, u in zip(list(token_ids), np.asarray(unknown, bool).tolist(),
                                             strict=True)]


def count_arg(n, what: str) -> int:
    """``n`` as a non-negative int, or ValueError."""
    if type(n) is not int:
        try:
            n = operator.index(n)
        except TypeError:
            raise ValueError(f"{what}={n!r} must be an int") from None
    if n < 0:
        raise ValueError(f"{what}={n} must be >= 0")
    return n


def token_list(token_ids: Sequence, what: str, *, unknown_ok: bool = False) -> list:
    """A new list of validated token ids (non-negative ints below 2**63; ``None`` too if
    ``unknown_ok``), or ValueError."""
    try:
        out = list(token_ids)
    except TypeError:
        raise ValueError(f"{what}={token_ids!r} must be a sequence of ints") from None
    if not out or set(map(type, out)) == _INT and min(out) >= 0 and max(out) < TOKEN_LIMIT:
        return out
    for i, t in enumerate(out):
        if t is None and unknown_ok:
            continue
        if type(t) is not int:
            try:
                t = out[i] = operator.index(t)
            except TypeError:
                raise ValueError(f"{what}[{i}]={t!r} is not an int") from None
        if not 0 <= t < TOKEN_LIMIT:
            raise ValueError(f"{what}[{i}]={t} must be a non-negative token id below 2**63")
    return out
