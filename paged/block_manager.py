"""Host half of paging: which physical page belongs to whom, when it may be shared or reused.

Plain Python bookkeeping, O(blocks touched) per operation (no scan of the pool):

* **Blocks.** Page ``NULL_PAGE`` is never handed out. Every other block is exactly one of: *free*
  (no content), *cached* (refcount 0, content indexed in the prefix cache, evictable in LRU
  order), *used* (refcount > 0) or *quarantined* (refcount 0 but not yet reusable, see below).
* **Sequences.** Each has a block table, its token ids (``None`` for lookahead slots whose draft
  tokens were not given), the number of slots whose KV is on device, and the prefix-cache keys of
  its full computed blocks.
* **All or nothing.** When the pool cannot satisfy a request the method returns ``None`` (or
  ``False``) and nothing changed, so the scheduler can preempt or wait. Misuse (unknown or
  duplicate sequence id, bad arguments) raises ``ValueError`` before any state changes.
* **Prefix cache** (`paged.prefix_cache`): only full blocks whose KV is on device (keyed in
  ``mark_computed``); the final prompt token is always recomputed. Freed cached blocks wait in an
  LRU, tail blocks of a sequence ahead of its head blocks; a hit revives them.
* **Copy-on-write.** A writer never writes into a shared block (refcount > 1): appending into a
  shared partial block takes a fresh block and returns a ``(src, dst)`` page copy. A block whose
  keyed content is about to be rewritten in place leaves the cache and changes version.
* **Quarantine.** A block whose last reference drops while a device step that may read it is in
  flight (``begin_step`` .. ``step_completed``) is not handed out, evicted or reported to
  ``on_free`` before that step completes (``quarantine_steps`` widens the window; 0 disables it).
  Independently of that window, a block that a returned copy still has to read or write (CoW
  ``src``/``dst``, swap-out page, swap-in page) is held until the step that performs the copy
  completes; host slots likewise. So pages reported free never have a pending copy, and the
  copies of one step may run in any order.

Device contract for one step (the engine): call the mutating methods while scheduling, then
``begin_step()``, then launch the step, which applies every copy returned since the previous
``begin_step`` (CoW, swap-out, swap-in; any order) before writing the step's KV, and optionally
poisons the pages given to ``on_free`` before that step's copies and writes; then
``step_completed(step_id)`` and ``mark_computed`` for each sequence whose KV the step wrote.
``append_decode_slots`` and ``mark_computed_many`` do the decode step's per-sequence calls in one.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence

from paged.kv_cache import NULL_PAGE
from paged.prefix_cache import (
    ROOT_DIGEST,
    BlockKey,
    HashFn,
    PrefixCacheIndex,
    keys_equal,
    sha256_block_hash,
)

FREE, CACHED, USED, QUARANTINED, NULL = 0, 1, 2, 3, 4
_TOKEN_LIMIT = 2**63  # token ids are hashed as int64
_sha256 = hashlib.sha256
_STATE_NAMES = ("free", "cached", "used", "quarantined", "null")


class _Seq:
    # The decode step reads the first four: declared first, they share the object's cache lines.
    __slots__ = ("room", "tokens", "num_computed", "key_at", "table", "keys", "salt",  # noqa: RUF023
                 "host_table", "dirty_tail", "swap_in_step", "swap_out_step", "unknown")

    def __init__(self, table, tokens, num_computed, keys, salt):
        self.table: list[int] = table  # physical blocks; empty while swapped out
        self.tokens: list[int | None] = tokens  # one per slot; None = lookahead with unknown id
        self.num_computed = num_computed  # tokens whose KV is on device
        self.keys: list[BlockKey] = keys  # prefix-cache keys of blocks 0 .. len(keys) - 1
        self.salt: bytes = salt
        self.host_table: list[int] | None = None  # host slots while swapped out
        self.dirty_tail = False  # tail block holds rolled-back slots that the next append rewrites
        self.swap_in_step = -1  # step that performs this sequence's latest swap-in copy
        self.swap_out_step = -1  # step that performs its latest swap-out copy
        # Fast-path state for decode. ``room`` is the exact number of free slots in the tail block
        # when that block is known to be exclusive, unkeyed and clean (0: the tail is full, the
        # next token takes a fresh block), or None when not known (fork, rollback, swap, debug).
        self.room: int | None = None
        # mark_computed may skip keying below this count; -1 forces the checked path.
        self.key_at = -1
        self.unknown = False  # some slot's token id is unknown (None)


def _as_salt(salt: bytes | str) -> bytes:
    if isinstance(salt, str):
        return salt.encode()
    if isinstance(salt, bytes | bytearray):
        return bytes(salt)
    raise ValueError(f"cache_salt={salt!r} must be bytes or str")


def _token_list(token_ids: Sequence[int], what: str) -> list[int]:
    try:
        out = list(token_ids)
    except TypeError:
        raise ValueError(f"{what}={token_ids!r} must be a sequence of ints") from None
    for i, t in enumerate(out):
        if type(t) is not int:
            try:
                t = out[i] = operator.index(t)
            except TypeError:
                raise ValueError(f"{what}[{i}]={t!r} is not an int") from None
        if not 0 <= t < _TOKEN_LIMIT:
            raise ValueError(f"{what}[{i}]={t} must be a non-negative token id below 2**63")
    return out


def _count(n, what: str) -> int:
    if type(n) is not int:
        try:
            n = operator.index(n)
        except TypeError:
            raise ValueError(f"{what}={n!r} must be an int") from None
    if n < 0:
        raise ValueError(f"{what}={n} must be >= 0")
    return n


class BlockManager:
    """Free list, refcounts, prefix cache, copy-on-write, quarantine window and swap accounting.

    Args:
      num_blocks: physical pages in the pool, counting ``NULL_PAGE`` (usable: num_blocks - 1).
      block_size: tokens per block.
      enable_prefix_caching: look up and key full blocks.
      cache_salt: default salt of every key (model, weights version, dtype, adapter, ...); a
        request may override it in ``allocate``.
      hash_fn: ``hash_fn(parent_digest | None, token_ids, salt) -> digest``; SHA-256 by default.
        Lookups verify the full key, so a weak function costs hit rate, never correctness.
      quarantine_steps: a block freed while steps are in flight is reusable once step
        ``last_begun + quarantine_steps - 1`` has completed (0 disables the window).
      num_host_blocks: host slots for ``swap_out``.
      debug: run ``check_invariants()`` after every mutating call (O(pool) each).
      on_free: called with the ids of blocks whose content just died (entered the free list, or
        were evicted from the prefix cache to be reused), at the end of the call that freed them.
        No returned copy reads or writes them any more; the engine may poison them with NaN before
        the next step's copies and writes.

    Raises:
      ValueError: for a bad argument.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 cache_salt: bytes | str = b"", hash_fn: HashFn | None = None,
                 quarantine_steps: int = 1, num_host_blocks: int = 0, debug: bool = False,
                 on_free: Callable[[list[int]], None] | None = None):
        if _count(num_blocks, "num_blocks") < 2:
            raise ValueError(f"{num_blocks=} must be >= 2 (the null page plus one usable block)")
        if _count(block_size, "block_size") < 1:
            raise ValueError(f"{block_size=} must be >= 1")
        _count(quarantine_steps, "quarantine_steps")
        _count(num_host_blocks, "num_host_blocks")
        if hash_fn is not None and not callable(hash_fn):
            raise ValueError(f"{hash_fn=} must be callable")
        if on_free is not None and not callable(on_free):
            raise ValueError(f"{on_free=} must be callable")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.cache_salt = _as_salt(cache_salt)
        self.quarantine_steps = quarantine_steps
        self.num_host_blocks = num_host_blocks
        self.debug = debug
        self._hash_fn = hash_fn or sha256_block_hash
        self._pack = None if hash_fn is not None else struct.Struct(f"<{block_size}q").pack
        self._on_free = on_free

        self._rc = [0] * num_blocks
        self._state = [FREE] * num_blocks
        self._state[NULL_PAGE] = NULL
        self._version = [0] * num_blocks  # bumped when handed out fresh or keyed content rewritten
        self._busy_until = [-1] * num_blocks  # step that performs a pending copy of this block
        self._copy_step = -1  # latest step given a copy to perform (any block)
        self._release_at = [-1] * num_blocks  # for quarantined blocks
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_PAGE)
        # Cached blocks, least recent first, with their key digests (eviction needs no key load).
        self._lru: OrderedDict[int, Hashable] = OrderedDict()
        self._held: dict[int, list[int]] = {}  # release step -> quarantined blocks (lazy deletes)
        self._num_held = 0
        self._num_used = 0
        self._cache = PrefixCacheIndex(num_blocks)

        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._host_busy_until = [-1] * num_host_blocks
        self._host_held: dict[int, list[int]] = {}
        self._num_host_held = 0

        self._seqs: dict[Hashable, _Seq] = {}
        # The last decode batch: (a copy of its ids, their _Seqs); dropped when _seqs changes.
        self._decode_batch: tuple[list, list[_Seq]] | None = None
        self._last_begun = -1
        self._last_completed = -1
        self._died: list[int] = []  # for on_free, flushed at the end of each call
        self._cow_src: dict[int, int] = {}  # CoW dst -> src for the copies of the coming step

        self._stats = dict(
            hits=0, misses=0, hit_tokens=0, query_tokens=0, allocations=0, failed_allocations=0,
            cow_copies=0, quarantined=0, revived=0, swapped_out_blocks=0, swapped_in_blocks=0)
        self._evictions = 0  # these two are attributes: the decode path bumps them
        self._peak_used = 0

    # --- steps and quarantine --------------------------------------------------------------
    def begin_step(self) -> int:
        """Returns the id of the device step about to be launched.

        Blocks freed from now on are quarantined until it completes. Copies returned since the
        previous ``begin_step`` belong to this step.
        """
        self._last_begun += 1
        self._cow_src.clear()
        return self._last_begun

    def step_completed(self, step_id: int) -> None:
        """Marks ``step_id`` and all earlier steps complete; blocks waiting on them become reusable.

        Raises:
          ValueError: if ``step_id`` was never begun.
        """
        if type(step_id) is not int or step_id < 0:
            step_id = _count(step_id, "step_id")
        if step_id > self._last_begun:
            raise ValueError(f"{step_id=} was not begun (last begun: {self._last_begun})")
        if step_id <= self._last_completed:
            return
        self._last_completed = step_id
        if self._held:
            for r in sorted(r for r in self._held if r <= step_id):
                for b in self._held.pop(r):
                    if self._state[b] == QUARANTINED and self._release_at[b] == r:
                        self._num_held -= 1
                        self._make_reusable(b)
        if self._host_held:
            for r in sorted(r for r in self._host_held if r <= step_id):
                slots = self._host_held.pop(r)
                self._num_host_held -= len(slots)
                self._host_free.extend(slots)
        if self._died or self.debug:
            self._end_call()

    @property
    def last_begun_step(self) -> int:
        return self._last_begun

    @property
    def last_completed_step(self) -> int:
        return self._last_completed

    # --- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no content, reusable now (excludes cached and quarantined blocks)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with refcount 0 whose content is cached (evictable, so also allocatable)."""
        return len(self._lru)

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks an allocation may take now: free plus evictable cached."""
        return len(self._free) + len(self._lru)

    @property
    def num_quarantined_blocks(self) -> int:
        return self._num_held

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_indexed_blocks(self) -> int:
        """Blocks with a prefix-cache key: cached, used or quarantined."""
        return len(self._cache)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def has_seq(self, seq_id) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id) -> bool:
        return self._seq(seq_id).host_table is not None

    def num_tokens(self, seq_id) -> int:
        """Slots of ``seq_id``: prompt, appended and lookahead tokens."""
        return len(self._seq(seq_id).tokens)

    def num_computed_tokens(self, seq_id) -> int:
        return self._seq(seq_id).num_computed

    def block_table(self, seq_id) -> list[int]:
        """A copy of the block table of a resident sequence (ValueError if swapped out)."""
        return list(self._resident(seq_id).table)

    def host_block_table(self, seq_id) -> list[int]:
        """A copy of the host slots of a swapped-out sequence."""
        seq = self._seq(seq_id)
        if seq.host_table is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        return list(seq.host_table)

    def refcount(self, block: int) -> int:
        return self._rc[block]

    def block_state(self, block: int) -> str:
        """'free', 'cached', 'used', 'quarantined' or 'null'."""
        return _STATE_NAMES[self._state[block]]

    def block_version(self, block: int) -> int:
        return self._version[block]

    def block_key(self, block: int) -> BlockKey | None:
        """The prefix-cache key ``block`` is indexed under, if any."""
        return self._cache.key[block]

    def seq_ids(self) -> list:
        return list(self._seqs)

    def evictable_blocks(self) -> list[int]:
        """Cached refcount-0 blocks in eviction order (next to be evicted first)."""
        return list(self._lru)

    def stats(self) -> dict:
        """Counters since construction plus the current pool split (all ints)."""
        return dict(
            self._stats, evictions=self._evictions, peak_used_blocks=self._peak_used,
            num_blocks=self.num_blocks, block_size=self.block_size,
            num_free_blocks=self.num_free_blocks, num_cached_blocks=self.num_cached_blocks,
            num_used_blocks=self._num_used, num_quarantined_blocks=self._num_held,
            num_indexed_blocks=len(self._cache), num_seqs=len(self._seqs),
            num_host_blocks=self.num_host_blocks, num_free_host_blocks=len(self._host_free),
            num_quarantined_host_blocks=self._num_host_held)

    def block_usage(self) -> list[tuple[int, int]]:
        """(refcount, filled token slots) of every used block, by block id; O(table entries).

        A shared block counts the most slots any of its sequences fills.
        """
        filled: dict[int, int] = {}
        B = self.block_size
        for seq in self._seqs.values():
            table = seq.table
            if not table:
                continue
            for b in table[:-1]:
                filled[b] = B
            last = table[-1]
            n = len(seq.tokens) - (len(table) - 1) * B
            if filled.get(last, 0) < n:
                filled[last] = n
        return [(self._rc[b], filled[b]) for b in sorted(filled)]

    # --- allocation ------------------------------------------------------------------------
    def can_allocate(self, prompt_token_ids: Sequence[int], *,
                     cache_salt: bytes | str | None = None) -> bool:
        """Whether ``allocate`` would succeed now (no side effects)."""
        tokens = self._prompt(prompt_token_ids)
        salt = self.cache_salt if cache_salt is None else _as_salt(cache_salt)
        hits = self._match_prefix(tokens, salt)
        return self._fresh_needed(len(tokens), hits) <= self._allocatable_excluding(hits)

    def allocate(self, seq_id, prompt_token_ids: Sequence[int], *,
                 cache_salt: bytes | str | None = None) -> int | None:
        """Creates ``seq_id`` holding the prompt: cached full blocks of its prefix, fresh blocks for
        the rest.

        Args:
          seq_id: a new sequence id (any hashable).
          prompt_token_ids: non-empty token ids.
          cache_salt: overrides the manager's salt for this sequence's keys.

        Returns:
          Prompt tokens already computed (served from the cache; a multiple of ``block_size``, less
          than the prompt length), or ``None`` if the pool cannot hold the prompt (nothing changed).

        Raises:
          ValueError: duplicate ``seq_id`` or bad tokens/salt.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens = self._prompt(prompt_token_ids)
        salt = self.cache_salt if cache_salt is None else _as_salt(cache_salt)
        hits = self._match_prefix(tokens, salt)
        need = self._fresh_needed(len(tokens), hits)
        if need > self._allocatable_excluding(hits):
            self._stats["failed_allocations"] += 1
            return None
        for b, _ in hits:  # revive before taking fresh blocks: never evict what we are about to hit
            self._acquire(b)
        table = [b for b, _ in hits] + self._take_fresh(need)
        num_hit = len(hits) * self.block_size
        seq = self._seqs[seq_id] = _Seq(table, tokens, num_hit, [k for _, k in hits], salt)
        self._decode_batch = None
        self._fast_state(seq)  # the tail block is fresh
        st = self._stats
        st["allocations"] += 1
        if self.enable_prefix_caching:
            eligible = (len(tokens) - 1) // self.block_size
            st["hits"] += len(hits)
            st["misses"] += eligible - len(hits)
            st["hit_tokens"] += num_hit
            st["query_tokens"] += len(tokens)
        self._end_call()
        return num_hit

    def num_slots_needed(self, seq_id, n: int) -> int:
        """Blocks ``append_slots`` of ``n`` tokens would take now, copy-on-write included."""
        seq = self._resident(seq_id)
        return self._grow_need(seq, _count(n, "n"))

    def append_slots(self, seq_id, new_token_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Grows ``seq_id`` by ``len(new_token_ids)`` slots whose KV the next step writes.

        Returns:
          Copy-on-write ``(src_page, dst_page)`` pairs the device must apply before the write, or
          ``None`` if the pool cannot supply the blocks (nothing changed).

        Raises:
          ValueError: unknown or swapped-out ``seq_id``, bad token ids.
        """
        try:
            seq = self._seqs[seq_id]
        except (KeyError, TypeError):
            seq = self._seq(seq_id)  # raises
        room = seq.room
        if room and len(new_token_ids) == 1:  # decode, in place: the tail block has room
            t = new_token_ids[0]
            if type(t) is int and 0 <= t < _TOKEN_LIMIT:
                seq.room = room - 1
                seq.tokens.append(t)
                return []
        elif room == 0 and len(new_token_ids) == 1:  # decode, the tail is full: one fresh block
            t = new_token_ids[0]
            if type(t) is int and 0 <= t < _TOKEN_LIMIT:
                if not (self._free or self._lru):
                    return None
                seq.table.append(self._take_one())
                seq.tokens.append(t)
                seq.room = self.block_size - 1
                if self._died:
                    self._end_call()
                return []
        if seq.host_table is not None:
            self._resident(seq_id)  # raises
        return self._grow(seq, _token_list(new_token_ids, "new_token_ids"))

    def append_decode_slots(self, seq_ids: Sequence, token_ids: Sequence[int]
                            ) -> list[tuple[int, int]] | None:
        """``append_slots(seq_ids[i], [token_ids[i]])`` for every i, in one call (the decode step).

        All or nothing: if the pool cannot supply every block (copies included), returns ``None``
        and nothing changed; the caller can fall back to per-sequence ``append_slots`` and preempt.

        Returns:
          The copy-on-write pairs of all sequences, or ``None``.

        Raises:
          ValueError: unknown, swapped-out or repeated sequence ids, bad token ids, or lengths
            that differ (before any state change).
        """
        last = self._decode_batch  # steady decoding repeats the batch: skip the lookups
        if (last is not None and type(seq_ids) is list and last[0] == seq_ids
                and len(token_ids) == len(seq_ids)):
            batch = last[1]
        else:
            batch = self._batch(seq_ids, token_ids)
            self._decode_batch = (list(seq_ids), batch)
        limit = _TOKEN_LIMIT
        starting = []  # full tails: these sequences start a fresh block
        # One pass in the common case (every tail exclusive, unkeyed and clean: ``room`` known),
        # undone if a sequence needs the general path or the pool runs short.
        for seq, t in zip(batch, token_ids):
            room = seq.room
            if type(t) is int and 0 <= t < limit:
                if room:
                    seq.room = room - 1
                    seq.tokens.append(t)
                    continue
                if room == 0:
                    starting.append(seq)
                    seq.tokens.append(t)
                    continue
            self._undo_decode(batch, seq, starting)  # room None (not known) or a bad token
            return self._append_decode_general(seq_ids, batch, token_ids)
        if starting:
            if len(starting) > len(self._free) + len(self._lru):
                self._undo_decode(batch, None, starting)
                return None
            B1 = self.block_size - 1
            for seq, b in zip(starting, self._take_fresh(len(starting))):
                seq.table.append(b)
                seq.room = B1
            if self._died:
                self._end_call()
        return []

    @staticmethod
    def _undo_decode(batch: list[_Seq], stop: _Seq | None, starting: list[_Seq]) -> None:
        """Reverts ``append_decode_slots``'s one pass over ``batch`` up to ``stop`` (exclusive)."""
        starting = set(starting)
        for seq in batch:
            if seq is stop:
                break
            seq.tokens.pop()
            if seq not in starting:
                seq.room += 1

    def _append_decode_general(self, seq_ids, batch: list[_Seq], token_ids: Sequence[int]
                               ) -> list[tuple[int, int]] | None:
        need = 0
        bad = False
        copied: dict[int, int] = {}  # shared tail -> sharers in this batch that copy it first
        for seq, t in zip(batch, token_ids, strict=True):  # check and count first
            if type(t) is not int or not 0 <= t < _TOKEN_LIMIT:
                bad = True
            room = seq.room
            if room is None:
                if seq.host_table is not None:
                    raise ValueError(f"a sequence in {seq_ids!r} is swapped out")
                if len(seq.tokens) % self.block_size:
                    tail = seq.table[-1]
                    k = copied.get(tail, 0)
                    if self._rc[tail] - k > 1:  # the last sharer to write keeps the block
                        need += 1
                        copied[tail] = k + 1
                else:
                    need += 1
            elif not room:
                need += 1
        if bad:
            token_ids = _token_list(token_ids, "token_ids")
        if need > len(self._free) + len(self._lru):
            return None
        pairs = []
        B = self.block_size
        for seq, t in zip(batch, token_ids, strict=True):
            room = seq.room
            if room:
                seq.room = room - 1
                seq.tokens.append(t)
            elif room is None:
                pairs += self._grow(seq, [t])
            else:
                seq.table.append(self._take_one())
                seq.tokens.append(t)
                seq.room = B - 1
        if self._died:
            self._end_call()
        return pairs

    def mark_computed_many(self, seq_ids: Sequence, num_computed_tokens: Sequence[int]) -> None:
        """``mark_computed(seq_ids[i], num_computed_tokens[i])`` for every i, in one call.

        Raises:
          ValueError: as ``mark_computed`` would for any pair, or for repeated ids, before any
            state change.
        """
        batch = self._batch(seq_ids, num_computed_tokens)
        counts = num_computed_tokens
        keying = []  # sequences whose count reaches a block that may get its key
        for seq, c in zip(batch, counts):  # validate everything first
            if type(c) is not int or not seq.num_computed <= c <= len(seq.tokens):
                break
            if c >= seq.key_at:
                if seq.host_table is not None:
                    break
                keying.append(seq)
        else:
            for seq, c in zip(batch, counts):
                seq.num_computed = c
            if keying:
                self._key_computed(keying)
            return
        counts = [self._check_computed(s, q, n)  # raises, or converts int-like counts
                  for s, q, n in zip(seq_ids, batch, counts, strict=True)]
        for seq, c in zip(batch, counts, strict=True):
            seq.num_computed = c
        self._key_computed([seq for seq, c in zip(batch, counts) if c >= seq.key_at])

    def _batch(self, seq_ids: Sequence, values: Sequence) -> list[_Seq]:
        try:
            batch = list(map(self._seqs.__getitem__, seq_ids))
        except (KeyError, TypeError):
            for s in seq_ids:
                self._seq(s)  # raises for the first unknown id
            raise
        if len(batch) != len(values):
            raise ValueError(f"{len(batch)} sequence ids but {len(values)} values")
        if len(set(batch)) != len(batch):  # a _Seq hashes by identity
            raise ValueError(f"repeated sequence ids in {seq_ids!r}")
        return batch

    def reserve_lookahead(self, seq_id, k: int, token_ids: Sequence[int] | None = None
                          ) -> list[tuple[int, int]] | None:
        """Reserves ``k`` speculative slots (draft tokens ``token_ids`` if known, for caching).

        Blocks holding lookahead slots of unknown token id are never keyed.

        Returns:
          CoW pairs, or ``None`` if out of blocks (nothing changed).
        """
        seq = self._resident(seq_id)
        k = _count(k, "k")
        if token_ids is not None:
            new = _token_list(token_ids, "token_ids")
            if len(new) != k:
                raise ValueError(f"len(token_ids)={len(new)} != k={k}")
            return self._grow(seq, new)
        was, seq.unknown = seq.unknown, seq.unknown or k > 0
        pairs = self._grow(seq, [None] * k)
        if pairs is None:
            seq.unknown = was
        return pairs

    def rollback(self, seq_id, r: int) -> None:
        """Drops the last ``r`` slots of ``seq_id``; blocks left empty are freed (tail first).

        Raises:
          ValueError: unknown or swapped-out ``seq_id``, or ``r`` larger than the sequence.
        """
        seq = self._resident(seq_id)
        r = _count(r, "r")
        n = len(seq.tokens)
        if r > n:
            raise ValueError(f"cannot roll back r={r} of {n} slots of sequence {seq_id!r}")
        if r == 0:
            return
        B = self.block_size
        new_n = n - r
        keep = -(-new_n // B)
        dropped = seq.table[keep:]
        del seq.table[keep:]
        del seq.tokens[new_n:]
        seq.num_computed = min(seq.num_computed, new_n)
        del seq.keys[new_n // B:]
        seq.dirty_tail = new_n % B != 0
        if seq.unknown:
            seq.unknown = None in seq.tokens
        seq.room = None
        self._set_key_at(seq)
        self._release(reversed(dropped))
        self._end_call()

    def mark_computed(self, seq_id, num_computed_tokens: int) -> None:
        """Records that KV for the first ``num_computed_tokens`` slots is on device (after the step
        that wrote it); full blocks among them get their prefix-cache keys now, never earlier.

        Raises:
          ValueError: unknown or swapped-out ``seq_id``; a count that decreases or exceeds the
            slots.
        """
        try:
            seq = self._seqs[seq_id]
        except (KeyError, TypeError):
            seq = self._seq(seq_id)  # raises
        c = num_computed_tokens
        if type(c) is int and seq.num_computed <= c < seq.key_at and c <= len(seq.tokens):
            seq.num_computed = c  # the decode fast path: no block completed
            return
        if seq.host_table is not None or type(c) is not int or not (
                seq.num_computed <= c <= len(seq.tokens)):
            c = self._check_computed(seq_id, seq, c)
        seq.num_computed = c
        self._key_computed((seq,))

    def _check_computed(self, seq_id, seq: _Seq, c) -> int:
        if seq.host_table is not None:
            self._resident(seq_id)  # raises
        if type(c) is not int or not seq.num_computed <= c <= len(seq.tokens):
            c = _count(c, "num_computed_tokens")
            if not seq.num_computed <= c <= len(seq.tokens):
                raise ValueError(
                    f"num_computed_tokens={c} must be in [{seq.num_computed}, {len(seq.tokens)}] "
                    f"for sequence {seq_id!r} (use rollback to shrink)")
        return c

    def fork(self, parent_seq_id, child_seq_id) -> None:
        """Makes ``child_seq_id`` share every block of ``parent_seq_id`` (refcount + 1 each).

        Raises:
          ValueError: unknown/swapped parent, existing child, or a parent with slots not yet
            computed (both would write the same shared block).
        """
        parent = self._resident(parent_seq_id)
        if child_seq_id in self._seqs:
            raise ValueError(f"sequence {child_seq_id!r} already exists")
        if parent.num_computed != len(parent.tokens):
            raise ValueError(
                f"cannot fork {parent_seq_id!r}: {len(parent.tokens) - parent.num_computed} of its "
                f"slots are not computed yet; fork after the step that writes them")
        child = _Seq(list(parent.table), list(parent.tokens), parent.num_computed,
                     list(parent.keys), parent.salt)
        child.dirty_tail = parent.dirty_tail
        child.unknown = parent.unknown
        parent.room = None  # the tail block is shared now
        self._set_key_at(child)
        child.swap_in_step = parent.swap_in_step
        for b in child.table:
            self._rc[b] += 1
        self._seqs[child_seq_id] = child
        self._decode_batch = None
        self._end_call()

    def free(self, seq_id) -> None:
        """Releases ``seq_id``: its blocks (tail first, so tail blocks are evicted first) or, if
        swapped out, its host slots. Quarantined while a step that may read them is in flight."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        self._decode_batch = None
        if seq.host_table is not None:
            self._release_host(seq.host_table)
        else:
            self._release(reversed(seq.table))
        self._end_call()

    def evict_cached(self, num_blocks: int | None = None) -> int:
        """Drops up to ``num_blocks`` (default all) cached blocks to the free list, LRU first."""
        n = len(self._lru) if num_blocks is None else min(_count(num_blocks, "num_blocks"),
                                                           len(self._lru))
        for _ in range(n):
            b, digest = self._lru.popitem(last=False)
            self._cache.remove(b, digest)
            self._state[b] = FREE
            self._free.append(b)
            self._died.append(b)
        self._evictions += n
        self._end_call()
        return n

    # --- swap ------------------------------------------------------------------------------
    def swap_out(self, seq_id) -> list[tuple[int, int]] | None:
        """Moves ``seq_id`` to host slots for preemption by swapping.

        Returns:
          ``(device_page, host_slot)`` copies for the next step, or ``None`` (nothing changed) if
          host slots run out or the sequence was swapped in since the last ``begin_step`` (its
          swap-in copy has not run yet; free it or wait a step). The device pages are released
          (held until the step performing the copy completes).

        Raises:
          ValueError: unknown or already swapped-out ``seq_id``.
        """
        seq = self._resident(seq_id)
        nxt = self._last_begun + 1
        if seq.swap_in_step == nxt or len(seq.table) > len(self._host_free):
            return None
        pairs = []
        for b in seq.table:
            h = self._host_free.popleft()
            self._host_busy_until[h] = nxt
            self._busy_until[b] = nxt
            # A CoW destination of the coming step is not filled yet: read its source (held,
            # unchanged until the step's writes), so the copies may run in any order.
            pairs.append((self._cow_src.get(b, b), h))
        seq.host_table = [h for _, h in pairs]
        seq.swap_out_step = self._copy_step = nxt
        self._release(reversed(seq.table))
        seq.table = []
        seq.dirty_tail = False
        seq.room = None
        seq.key_at = -1
        self._stats["swapped_out_blocks"] += len(pairs)
        self._end_call()
        return pairs

    def can_swap_in(self, seq_id) -> bool:
        """Whether ``swap_in`` would succeed now (ValueError if ``seq_id`` is not swapped out)."""
        seq = self._seq(seq_id)
        if seq.host_table is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        return (seq.swap_out_step != self._last_begun + 1
                and len(seq.host_table) <= self.num_allocatable_blocks)

    def swap_in(self, seq_id) -> list[tuple[int, int]] | None:
        """Brings a swapped-out ``seq_id`` back into fresh device blocks.

        Returns:
          ``(host_slot, device_page)`` copies for the next step, or ``None`` (nothing changed) if
          the pool cannot hold it or it was swapped out since the last ``begin_step`` (its
          swap-out copy has not run yet). Its full blocks are keyed again at the next
          ``mark_computed`` after the copy ran.

        Raises:
          ValueError: unknown or resident ``seq_id``.
        """
        if not self.can_swap_in(seq_id):
            return None
        seq = self._seqs[seq_id]
        nxt = self._last_begun + 1
        fresh = self._take_fresh(len(seq.host_table))
        pairs = list(zip(seq.host_table, fresh, strict=True))
        for h, b in pairs:
            self._host_busy_until[h] = self._busy_until[b] = nxt
        self._copy_step = nxt
        self._release_host(seq.host_table)
        seq.host_table = None
        seq.table = fresh
        seq.keys = []  # re-keyed (and deduplicated) once the swap-in copy has run
        seq.swap_in_step = nxt
        self._fast_state(seq)
        self._stats["swapped_in_blocks"] += len(pairs)
        self._end_call()
        return pairs

    # --- internals -------------------------------------------------------------------------
    def _seq(self, seq_id) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        return seq

    def _resident(self, seq_id) -> _Seq:
        seq = self._seq(seq_id)
        if seq.host_table is not None:
            raise ValueError(f"sequence {seq_id!r} is swapped out")
        return seq

    def _prompt(self, prompt_token_ids) -> list[int]:
        tokens = _token_list(prompt_token_ids, "prompt_token_ids")
        if not tokens:
            raise ValueError("prompt_token_ids must not be empty")
        return tokens

    def _match_prefix(self, tokens: list[int], salt: bytes) -> list[tuple[int, BlockKey]]:
        """Cached blocks serving the longest prefix of full blocks, never the final token."""
        if not self.enable_prefix_caching:
            return []
        B = self.block_size
        cache, versions, pack = self._cache, self._version, self._pack
        hits = []
        parent = None
        for i in range((len(tokens) - 1) // B):
            ids = tuple(tokens[i * B:(i + 1) * B])
            if pack is not None:  # == sha256_block_hash(parent digest, ids, salt)
                digest = _sha256((ROOT_DIGEST if parent is None else parent.digest) + pack(*ids)
                                 + salt).digest()
            else:
                digest = self._hash_fn(None if parent is None else parent.digest, ids, salt)
            b = cache.find(digest, parent, ids, salt, versions)
            if b is None:
                break
            parent = cache.key[b]
            hits.append((b, parent))
        return hits

    def _fresh_needed(self, n: int, hits) -> int:
        return -(-n // self.block_size) - len(hits)

    def _allocatable_excluding(self, hits) -> int:
        revived = sum(1 for b, _ in hits if self._state[b] == CACHED)
        return len(self._free) + len(self._lru) - revived

    def _acquire(self, b: int) -> None:
        """One more reference to a cached (possibly refcount-0) block."""
        rc = self._rc[b]
        if rc == 0:
            if self._state[b] == CACHED:
                del self._lru[b]
            else:  # quarantined: its content is intact and a hit only reads it
                self._num_held -= 1
            self._state[b] = USED
            self._num_used += 1
            self._stats["revived"] += 1
        self._rc[b] = rc + 1

    def _take_fresh(self, n: int) -> list[int]:
        """``n`` blocks with new content (caller checked capacity): free ones first, then LRU."""
        free = self._free
        if len(free) >= n:
            out = [free.popleft() for _ in range(n)]
        else:
            out = list(free)
            free.clear()
            lru, remove = self._lru, self._cache.remove
            evicted = []
            for _ in range(n - len(out)):
                b, digest = lru.popitem(last=False)
                remove(b, digest)
                evicted.append(b)
            self._evictions += len(evicted)
            if self._on_free is not None:
                self._died += evicted
            out += evicted
        versions, rc, state = self._version, self._rc, self._state
        for b in out:
            versions[b] += 1
            rc[b] = 1
            state[b] = USED
        self._num_used += n
        if self._num_used > self._peak_used:
            self._peak_used = self._num_used
        return out

    def _take_one(self) -> int:
        """``_take_fresh(1)[0]`` for the per-sequence decode path."""
        if self._free:
            b = self._free.popleft()
        else:
            b, digest = self._lru.popitem(last=False)
            self._cache.remove(b, digest)
            self._evictions += 1
            if self._on_free is not None:  # else nobody reads it: spare the flush
                self._died.append(b)
        self._version[b] += 1
        self._rc[b] = 1
        self._state[b] = USED
        self._num_used += 1
        if self._num_used > self._peak_used:
            self._peak_used = self._num_used
        return b

    def _fast_state(self, seq: _Seq) -> None:
        """Sets the decode fast-path state after the tail block was made exclusive and clean."""
        seq.room = None if self.debug else -len(seq.tokens) % self.block_size
        self._set_key_at(seq)

    def _set_key_at(self, seq: _Seq) -> None:
        if self.debug or seq.host_table is not None:
            seq.key_at = -1
        elif self.enable_prefix_caching:
            seq.key_at = (len(seq.keys) + 1) * self.block_size
        else:
            seq.key_at = _TOKEN_LIMIT

    def _release(self, blocks) -> None:
        """Drops one reference to each block, in the order given (LRU order for cached ones)."""
        window = self._last_begun + self.quarantine_steps - 1 if self.quarantine_steps else -1
        done = self._last_completed
        for b in blocks:
            rc = self._rc[b] - 1
            self._rc[b] = rc
            if rc:
                continue
            self._num_used -= 1
            release = max(window, self._busy_until[b])
            if release > done:
                self._state[b] = QUARANTINED
                self._release_at[b] = release
                self._held.setdefault(release, []).append(b)
                self._num_held += 1
                self._stats["quarantined"] += 1
            else:
                self._make_reusable(b)

    def _make_reusable(self, b: int) -> None:
        key = self._cache.key[b]
        if key is not None:
            self._state[b] = CACHED
            self._lru[b] = key.digest
        else:
            self._state[b] = FREE
            self._free.append(b)
            self._died.append(b)

    def _release_host(self, slots: list[int]) -> None:
        done = self._last_completed
        for h in slots:
            release = self._host_busy_until[h]
            if release > done:
                self._host_held.setdefault(release, []).append(h)
                self._num_host_held += 1
            else:
                self._host_free.append(h)

    def _grow_need(self, seq: _Seq, m: int) -> int:
        if m == 0:
            return 0
        n = len(seq.tokens)
        cow = n % self.block_size != 0 and self._rc[seq.table[-1]] > 1
        return -(-(n + m) // self.block_size) - len(seq.table) + cow

    def _grow(self, seq: _Seq, new: list) -> list[tuple[int, int]] | None:
        m = len(new)
        if m == 0:
            return []
        need = self._grow_need(seq, m)
        if need > len(self._free) + len(self._lru):
            return None
        fresh = self._take_fresh(need)
        pairs = []
        if len(seq.tokens) % self.block_size:
            last = seq.table[-1]
            if self._rc[last] > 1:  # copy-on-write: never write into a shared block
                dst = fresh.pop(0)
                self._rc[last] -= 1
                nxt = self._last_begun + 1
                self._busy_until[last] = self._busy_until[dst] = nxt
                self._copy_step = nxt
                seq.table[-1] = dst
                self._cow_src[dst] = last
                pairs.append((last, dst))
                self._stats["cow_copies"] += 1
            elif self._cache.key[last] is not None or seq.dirty_tail:
                # Rewriting slots in place: the keyed content (if any) dies with it.
                if self._cache.key[last] is not None:
                    self._cache.remove(last, self._cache.key[last].digest)
                self._version[last] += 1
        seq.dirty_tail = False
        seq.table.extend(fresh)
        seq.tokens.extend(new)
        self._fast_state(seq)
        self._end_call()
        return pairs

    def _key_computed(self, seqs) -> None:
        """Keys the full computed blocks of each of ``seqs`` that have no key yet, indexing each
        unless an equal key is indexed already (then the sequence adopts that key, so chains keep
        comparing by identity).

        Stops at a block whose copy has not run yet or that holds a slot of unknown token id.
        """
        if not self.enable_prefix_caching:
            return
        B = self.block_size
        busy, done, versions = self._busy_until, self._last_completed, self._version
        copying = self._copy_step > done  # some block may have a copy pending
        cache = self._cache
        cache_key, buckets, cache_version = cache.key, cache.buckets, cache.version
        pack = self._pack  # set when hash_fn is the default: hash inline (the decode hot path)
        for seq in seqs:
            keys = seq.keys
            i = len(keys)
            upto = seq.num_computed // B
            if upto <= i:
                continue
            tokens, table, salt = seq.tokens, seq.table, seq.salt
            parent = keys[-1] if i else None
            while i < upto:
                b = table[i]
                if copying and busy[b] > done:  # its copy has not run yet
                    break
                ids = tuple(tokens[i * B:(i + 1) * B])
                if seq.unknown and None in ids:  # a lookahead slot of unknown token: stop here
                    break
                if pack is not None:  # == sha256_block_hash(parent digest, ids, salt)
                    digest = _sha256((ROOT_DIGEST if parent is None else parent.digest)
                                     + pack(*ids) + salt).digest()
                else:
                    digest = self._hash_fn(None if parent is None else parent.digest, ids, salt)
                if cache_key[b] is None and buckets.setdefault(digest, b) is b:
                    # New content (cache.intern's common case, inlined): index b under a new key.
                    parent = cache_key[b] = BlockKey(parent, ids, salt, digest)
                    cache_version[b] = versions[b]
                else:
                    parent = cache.intern(b, parent, ids, salt, digest, versions)
                keys.append(parent)
                i += 1
            if self.debug:
                self.check_invariants()
            else:
                seq.key_at = (i + 1) * B

    def _end_call(self) -> None:
        if self._died:
            died, self._died = self._died, []
            if self._on_free is not None:
                self._on_free(died)
        if self.debug:
            self.check_invariants()

    # --- debug -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Checks the whole state in O(pool + table entries).

        Raises:
          AssertionError: with a message naming the first violation found.
        """
        def fail(msg):
            raise AssertionError(f"BlockManager invariant violated: {msg}")

        nb, B = self.num_blocks, self.block_size
        if self._state[NULL_PAGE] != NULL or self._rc[NULL_PAGE] != 0:
            fail(f"NULL_PAGE has state {self.block_state(NULL_PAGE)}, "
                 f"refcount {self._rc[NULL_PAGE]}")
        refs = [0] * nb
        for sid, seq in self._seqs.items():
            if seq.num_computed > len(seq.tokens) or len(seq.keys) > seq.num_computed // B:
                fail(f"seq {sid!r}: computed={seq.num_computed} keys={len(seq.keys)} "
                     f"tokens={len(seq.tokens)}")
            if seq.host_table is not None:
                if seq.table or len(seq.host_table) != -(-len(seq.tokens) // B):
                    fail(f"swapped seq {sid!r} table={seq.table} host={seq.host_table}")
                continue
            if len(seq.table) != -(-len(seq.tokens) // B):
                fail(f"seq {sid!r} has {len(seq.table)} blocks for {len(seq.tokens)} tokens")
            if not seq.unknown and None in seq.tokens:
                fail(f"seq {sid!r} has slots of unknown token id but is not flagged")
            if seq.room is not None and (
                    seq.room != -len(seq.tokens) % B or seq.room and (
                        self._rc[seq.table[-1]] != 1 or seq.dirty_tail
                        or self._cache.key[seq.table[-1]] is not None)):
                fail(f"seq {sid!r} may append {seq.room} slots in place into a tail block that is "
                     f"shared, keyed or dirty, or has a different number of free slots")
            if seq.key_at > (len(seq.keys) + 1) * B and self.enable_prefix_caching:
                fail(f"seq {sid!r} skips keying up to {seq.key_at} tokens "
                     f"with {len(seq.keys)} keys")
            for i, b in enumerate(seq.table):
                if not 0 <= b < nb or b == NULL_PAGE:
                    fail(f"seq {sid!r} block {i} is {b}")
                if self._state[b] != USED:
                    fail(f"seq {sid!r} references block {b} in state {self.block_state(b)}")
                refs[b] += 1
            for i, key in enumerate(seq.keys):
                if key.token_ids != tuple(seq.tokens[i * B:(i + 1) * B]) or key.salt != seq.salt:
                    fail(f"seq {sid!r} key {i} does not match its tokens")
                parent = seq.keys[i - 1] if i else None
                if not keys_equal(key.parent, parent):
                    fail(f"seq {sid!r} key {i} has the wrong parent")
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            fail("duplicate block in the free list")
        held = {b for r, bs in self._held.items() for b in bs
                if self._state[b] == QUARANTINED and self._release_at[b] == r}
        counts = [0] * 5
        for b in range(nb):
            st = self._state[b]
            counts[st] += 1
            if b == NULL_PAGE:
                continue
            if refs[b] != self._rc[b]:
                fail(f"block {b} refcount {self._rc[b]} != {refs[b]} table references")
            if (st == USED) != (self._rc[b] > 0):
                fail(f"block {b} in state {self.block_state(b)} has refcount {self._rc[b]}")
            if (b in free_set) != (st == FREE) or (b in self._lru) != (st == CACHED):
                fail(f"block {b} state {self.block_state(b)} disagrees with free list / LRU")
            if (b in held) != (st == QUARANTINED):
                fail(f"block {b} state {self.block_state(b)} disagrees with the quarantine")
            if st == QUARANTINED and self._release_at[b] <= self._last_completed:
                fail(f"block {b} still quarantined after step {self._release_at[b]} completed")
            keyed = self._cache.key[b] is not None
            if st == FREE and keyed or st == CACHED and not keyed:
                fail(f"block {b} in state {self.block_state(b)} has key={keyed}")
            if st in (FREE, CACHED) and self._busy_until[b] > self._last_completed:
                fail(f"reusable block {b} has a copy pending in step {self._busy_until[b]}")
            if self._busy_until[b] > self._copy_step:
                fail(f"block {b} has a copy in step {self._busy_until[b]} after the latest "
                     f"copy step {self._copy_step}")
            if st == CACHED and self._lru[b] != self._cache.key[b].digest:
                fail(f"cached block {b} waits in the LRU under digest {self._lru[b]!r}, "
                     f"not its key's")
        if (counts[FREE], counts[CACHED], counts[USED], counts[QUARANTINED]) != (
                len(self._free), len(self._lru), self._num_used, self._num_held):
            fail(f"state counts {counts} vs free={len(self._free)} lru={len(self._lru)} "
                 f"used={self._num_used} held={self._num_held}")
        if sum(counts) != nb:
            fail(f"state counts {counts} do not sum to {nb}")
        self._cache.check(self._version)
        host = list(self._host_free) + [h for hs in self._host_held.values() for h in hs]
        if len(host) != len(self._host_free) + self._num_host_held:
            fail("host quarantine count is off")
        for seq in self._seqs.values():
            if seq.host_table is not None:
                host += seq.host_table
        if sorted(host) != list(range(self.num_host_blocks)):
            fail(f"host slots are not partitioned: {sorted(host)}")

