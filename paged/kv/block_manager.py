"""Host half of paging: which physical page belongs to whom, when it may be shared or reused.

Plain Python bookkeeping, O(blocks touched) per operation (no scan of the pool). `BlockManager` is
the facade over the parts in `paged.kv.blocks`:

* **Blocks** (`paged.kv.blocks.pool`). Page ``NULL_PAGE`` is never handed out. Every other block is
  exactly one of: *free* (no content), *cached* (refcount 0, content indexed in the prefix cache,
  evictable in LRU order), *used* (refcount > 0) or *quarantined* (refcount 0 but not yet
  reusable, see below).
* **Sequences** (`paged.kv.blocks.tables`). Each has a block table, its token ids (``None`` for a
  slot whose token id is not known yet), the number of slots whose KV is on device, and the
  prefix-cache keys of its full computed blocks; token ids and counters are rows of one int64
  array (`paged.kv.blocks.token_rows`), so the decode calls take the engine's arrays.
* **All or nothing.** When the pool cannot satisfy a request the method returns ``None`` (or
  ``False``) and nothing changed, so the scheduler can preempt or wait. Misuse (unknown or
  duplicate sequence id, bad arguments) raises ``ValueError`` before any state changes.
* **Prefix cache** (`paged.kv.blocks.prefix_index`): only full blocks whose KV is on device and whose
  token ids are all known (keyed in ``mark_computed`` or ``set_tokens``); the final prompt token
  is always recomputed. Freed cached blocks wait in an LRU, tail blocks of a sequence ahead of its
  head blocks; a hit revives them. Admission hashes a prompt once (`paged.kv.blocks.admission`).
* **Copy-on-write.** A writer never writes into a shared block (refcount > 1): appending into a
  shared partial block takes a fresh block and returns a ``(src, dst)`` page copy. A block whose
  keyed content is about to be rewritten in place leaves the cache and changes version.
* **Sliding windows** (`paged.kv.blocks.window`). With ``sliding_window=W`` (a model whose every
  layer slides), a sequence's leading blocks that are wholly behind the window of every query it
  will still compute are recycled after each ``mark_computed`` (and at admission): their table
  entries become ``NULL_PAGE`` and the blocks are released like freed ones (quarantine applies).
* **Quarantine** (`paged.kv.blocks.fence`). A block whose last reference drops while a device step
  that may read it is in flight (``begin_step`` .. ``step_completed``) is not handed out, evicted
  or reported to ``on_free`` before that step completes (``quarantine_steps`` widens the window; 0
  disables it). Independently of that window, a block that a returned copy still has to read or
  write (CoW ``src``/``dst``, swap-out page, swap-in page) is held until the step that performs
  the copy completes; host slots likewise. So pages reported free never have a pending copy, and
  the copies of one step may run in any order.

Device contract for one step (the engine): call the mutating methods while scheduling, then
``begin_step()``, then launch the step, which applies every copy returned since the previous
``begin_step`` (CoW, swap-out, swap-in; any order) before writing the step's KV, and optionally
poisons the pages given to ``on_free`` before that step's copies and writes; then
``step_completed(step_id)`` and ``mark_computed`` for each sequence whose KV the step wrote.
``append_decode_slots`` and ``mark_computed_many`` do the decode step's per-sequence calls in one.
An overlapped engine may schedule a decode slot before its token id is known (``None``) and fill
it in later with ``set_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from paged.kv import events
from paged.kv.blocks import decode_run
from paged.kv.blocks.admission import Admission, as_salt
from paged.kv.blocks.compact import Compaction, compact
from paged.kv.blocks.eviction import make_order
from paged.kv.blocks.host_tier import HostTier
from paged.kv.blocks.invariants import check_invariants
from paged.kv.blocks.offload import OffloadCalls
from paged.kv.blocks.policy_calls import PolicyCalls
from paged.kv.blocks.prefix_index import HashFn, PrefixKeyer, xxh3_block_hash
from paged.kv.blocks.progress import Progress
from paged.kv.blocks.queries import ManagerQueries
from paged.kv.blocks.residency import Residency, listeners
from paged.kv.blocks.shared import SharedParts
from paged.kv.blocks.swap import Swapper
from paged.kv.blocks.tables import SeqTables, count_arg
from paged.kv.blocks.window import WindowRecycler


def _check_args(num_blocks, block_size, quarantine_steps, num_host_blocks, hash_fn, on_free,
                sliding_window):
    if count_arg(num_blocks, "num_blocks") < 2:
        raise ValueError(f"{num_blocks=} must be >= 2 (the null page plus one usable block)")
    if count_arg(block_size, "block_size") < 1:
        raise ValueError(f"{block_size=} must be >= 1")
    count_arg(quarantine_steps, "quarantine_steps")
    count_arg(num_host_blocks, "num_host_blocks")
    if hash_fn is not None and not callable(hash_fn):
        raise ValueError(f"{hash_fn=} must be callable")
    if on_free is not None and not callable(on_free):
        raise ValueError(f"{on_free=} must be callable")
    if sliding_window is not None and count_arg(sliding_window, "sliding_window") < block_size:
        raise ValueError(f"{sliding_window=} is shorter than a block ({block_size=}): serve it "
                         "with block_size <= sliding_window")


class BlockManager(ManagerQueries, OffloadCalls, PolicyCalls):
    """Free list, refcounts, prefix cache, copy-on-write, quarantine window and swap accounting.

    Args:
      num_blocks: physical pages in the pool, counting ``NULL_PAGE`` (usable: num_blocks - 1).
      block_size: tokens per block.
      enable_prefix_caching: look up and key full blocks.
      cache_salt: default salt of every key (model, weights version, dtype, adapter, ...); a
        request may override it in ``allocate``.
      hash_fn: ``hash_fn(parent_digest | None, token_ids, salt) -> digest``; 128-bit XXH3 by
        default (``paged.kv.blocks.prefix_index.xxh3_block_hash``; ``sha256_block_hash`` is the
        cryptographic option). Lookups verify the full key, so a weak function costs hit rate,
        never correctness.
      quarantine_steps: a block freed while steps are in flight is reusable once step
        ``last_begun + quarantine_steps - 1`` has completed (0 disables the window).
      num_host_blocks: host slots for ``swap_out``.
      debug: run ``check_invariants()`` after every mutating call (O(pool) each).
      on_free: called with the ids of blocks whose content just died (entered the free list, or
        were evicted from the prefix cache to be reused), at the end of the call that freed them.
        No returned copy reads or writes them any more; the engine may poison them with NaN before
        the next step's copies and writes.
      sliding_window: W when every layer of the model attends through a sliding window of W
        tokens: blocks behind every future query's window are recycled (`paged.kv.blocks.window`).
        At least ``block_size``. None: full attention, nothing recycled.
      parts: the pool, fence and prefix index to draw from, shared with other managers (one
        KV-cache group each, `paged.kv.group_manager`); None builds this manager's own.

    Raises:
      ValueError: for a bad argument.
    """

    num_groups = 1  # one block table per sequence (KV-cache groups: `paged.kv.group_manager`)

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 cache_salt: bytes | str = b"", hash_fn: HashFn | None = None,
                 quarantine_steps: int = 1, num_host_blocks: int = 0, debug: bool = False,
                 on_free: Callable[[list[int]], None] | None = None,
                 sliding_window: int | None = None, num_host_tier_blocks: int = 0,
                 parts: SharedParts | None = None, prefix_eviction: str = "lru"):
        _check_args(num_blocks, block_size, quarantine_steps, num_host_blocks, hash_fn, on_free,
                    sliding_window)
        if count_arg(num_host_tier_blocks, "num_host_tier_blocks") and sliding_window is not None:
            raise ValueError(f"{num_host_tier_blocks=}: the host tier does not serve a sliding-"
                             f"window model ({sliding_window=})")
        self.sliding_window = sliding_window
        self.compacted_blocks = 0  # blocks freed by KV-policy compaction since construction
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.cache_salt = as_salt(cache_salt)
        self.quarantine_steps = quarantine_steps
        self.num_host_blocks = num_host_blocks
        self.debug = debug
        own_parts = parts is None
        if parts is None:
            parts = SharedParts.build(num_blocks, quarantine_steps, num_host_blocks, on_free,
                                      eviction=prefix_eviction, block_size=block_size)
        self._index, self._pool, self._fence = parts.index, parts.pool, parts.fence
        self._keyer = PrefixKeyer(self._index, block_size, hash_fn or xxh3_block_hash,
                                  self._pool.version, self._fence,
                                  enabled=self.enable_prefix_caching, debug=debug)
        self._tables = SeqTables(self._pool, self._fence, self._index, block_size,
                                 enable_prefix_caching=self.enable_prefix_caching, debug=debug)
        self._progress = Progress(self._tables, self._keyer)
        self._tier = None
        self._events = None  # the KV event sink (``set_event_sink``)
        if num_host_tier_blocks:
            order = None if prefix_eviction == "lru" else (
                lambda index: make_order(prefix_eviction, num_host_tier_blocks, index, block_size))
            self._tier = HostTier(num_host_tier_blocks, self._keyer, self._fence, order)
            self._pool.spill = self._tier.offer
        self._admission = Admission(self._pool, self._keyer, self._tables, self.cache_salt,
                                    self._tier)
        self._swap = Swapper(self._pool, self._fence, self._tables)
        # Residency figures per tier (`paged.kv.blocks.residency`), for a manager with its own
        # index (a KV-cache group's shares its index: none).
        self._residency = None
        if own_parts:
            self._residency = (Residency(num_blocks), None if self._tier is None
                               else Residency(num_host_tier_blocks))
            self._admission.residency = self._residency
        self._wire_listeners()
        self._window = None if sliding_window is None else WindowRecycler(
            self._tables, self._fence, sliding_window)
        if not debug and self._window is None:
            # Nothing is left to do after these per-sequence calls (no check; blocks they evict
            # are reported by the part itself): skip the facade's frame.
            self.append_slots = self._tables.append_slots
            self.mark_computed = self._progress.mark_computed

    def _end_call(self) -> None:
        """After a mutating call: report dead blocks to ``on_free``; check everything if debug."""
        self._pool.flush()
        if self.debug:
            self.check_invariants()

    # --- steps and quarantine --------------------------------------------------------------
    def begin_step(self) -> int:
        """Returns the id of the device step about to be launched.

        Blocks freed from now on are quarantined until it completes. Copies returned since the
        previous ``begin_step`` belong to this step.
        """
        return self._fence.begin()

    def step_completed(self, step_id: int) -> None:
        """Marks ``step_id`` and all earlier steps complete; blocks waiting on them become reusable.

        Raises:
          ValueError: if ``step_id`` was never begun.
        """
        if type(step_id) is not int or step_id < 0:
            step_id = count_arg(step_id, "step_id")
        if step_id > self._fence.last_begun:
            raise ValueError(f"{step_id=} was not begun (last begun: {self._fence.last_begun})")
        self._fence.complete(step_id)
        if self._tier is not None:
            self._tier.complete(step_id)
        if self._pool.died or self.debug:
            self._end_call()

    @property
    def last_begun_step(self) -> int:
        return self._fence.last_begun

    @property
    def last_completed_step(self) -> int:
        return self._fence.last_completed

    # Read-only queries: `paged.kv.blocks.queries`; swap and host tier: `paged.kv.blocks.offload`.

    @property
    def seq_tables(self) -> SeqTables:
        """The sequence-tables part (read by the invariant check of KV-cache groups sharing
        this manager's pool, `paged.kv.group_manager`)."""
        return self._tables

    def take_recycled_seqs(self) -> set:
        """Sequences whose block tables lost leading blocks to the sliding window since the last
        call (a copy of their table held elsewhere is stale); empty without a window."""
        return set() if self._window is None else self._window.take_changed()

    # --- allocation ------------------------------------------------------------------------
    def can_allocate(self, prompt_token_ids: Sequence[int], *,
                     cache_salt: bytes | str | None = None) -> bool:
        """Whether ``allocate`` would succeed now (no side effects on the pool or the cache).

        Remembers the prompt's prefix hits: the ``allocate`` of the same token list and salt that
        follows does not hash the prompt again unless the prefix cache changed in between.
        """
        return self._admission.can_allocate(prompt_token_ids, cache_salt)

    def allocate(self, seq_id, prompt_token_ids: Sequence[int], *,
                 cache_salt: bytes | str | None = None, max_hit_blocks: int | None = None
                 ) -> int | None:
        """Creates ``seq_id`` holding the prompt: cached full blocks of its prefix, fresh blocks for
        the rest.

        Args:
          seq_id: a new sequence id (any hashable).
          prompt_token_ids: non-empty token ids.
          cache_salt: overrides the manager's salt for this sequence's keys.
          max_hit_blocks: serve at most this many leading blocks from the cache (None: all).

        Returns:
          Prompt tokens already computed (served from the cache; a multiple of ``block_size``, less
          than the prompt length), or ``None`` if the pool cannot hold the prompt (nothing changed).

        Raises:
          ValueError: duplicate ``seq_id`` or bad tokens/salt.
        """
        hit = self._admission.allocate(seq_id, prompt_token_ids, cache_salt, max_hit_blocks)
        if hit is not None and self._window is not None:
            self._window.recycle((seq_id,))
        self._end_call()
        return hit

    def num_slots_needed(self, seq_id, n: int) -> int:
        """Blocks ``append_slots`` of ``n`` tokens would take now, copy-on-write included."""
        seq = self._tables.resident(seq_id)
        return self._tables.grow_need(seq, count_arg(n, "n"))

    def append_slots(self, seq_id, new_token_ids: Sequence[int | None]
                     ) -> list[tuple[int, int]] | None:
        """Grows ``seq_id`` by ``len(new_token_ids)`` slots whose KV the next step writes.

        A ``None`` token id means "not known yet" (``set_tokens`` fills it in later); a block holding
        such a slot is not keyed into the prefix cache while it does.

        Returns:
          Copy-on-write ``(src_page, dst_page)`` pairs the device must apply before the write, or
          ``None`` if the pool cannot supply the blocks (nothing changed).

        Raises:
          ValueError: unknown or swapped-out ``seq_id``, bad token ids.
        """
        pairs = self._tables.append_slots(seq_id, new_token_ids)
        if self.debug:
            self.check_invariants()
        return pairs

    def append_decode_slots(self, seq_ids: Sequence, token_ids: Sequence[int | None],
                            unknown=None) -> list[tuple[int, int]] | None:
        """``append_slots(seq_ids[i], [token_ids[i]])`` for every i, in one call (the decode step).

        All or nothing: if the pool cannot supply every block (copies included), returns ``None``
        and nothing changed; the caller can fall back to per-sequence ``append_slots`` and preempt.
        ``None`` token ids are allowed as in ``append_slots``. Token ids may be an integer
        ndarray (no Python loop over it); ``unknown``, a bool array as long, marks the slots whose
        token id is not known yet (the ndarray's values there are ignored; the engine's rows).

        Returns:
          The copy-on-write pairs of all sequences, or ``None``.

        Raises:
          ValueError: unknown, swapped-out or repeated sequence ids, bad token ids, or lengths
            that differ (before any state change).
        """
        pairs = self._tables.append_decode(self._tables.lookup(seq_ids, token_ids), token_ids,
                                           unknown)
        if self.debug:
            self.check_invariants()
        return pairs

    def run_decode_steps(self, seq_ids: Sequence, token_ids: Sequence[Sequence[int]]) -> bool:
        """``m = len(token_ids[i])`` steady decode steps of ``seq_ids`` in one call (a simulator
        that knows the next steps are pure decodes): the state of ``m`` rounds of
        ``append_decode_slots``, ``step_completed(begin_step())`` and ``mark_computed_many`` of
        the blocks each step filled, ids, LRU order, quarantine and keys included. ``False``
        (nothing changed) if the pool cannot supply it; ``ValueError`` for a bad call, before
        any change (``paged.kv.blocks.decode_run.run``). Not with a sliding window (ValueError):
        recycling happens per step."""
        if self._window is not None:
            raise ValueError("run_decode_steps does not recycle sliding-window blocks; step "
                             "instead (sliding_window is set)")
        done = decode_run.run(self._tables, self._progress, self._fence, seq_ids, token_ids)
        if done and self.debug:
            self.check_invariants()
        return done

    def set_tokens(self, seq_ids: Sequence, positions: Sequence[int],
                   token_ids: Sequence[int]) -> None:
        """Slot ``positions[i]`` (0-based over all slots, prompt included) of ``seq_ids[i]`` holds
        an unknown token id (``None``) and gets ``token_ids[i]``, for every i; O(pairs + blocks
        keyed). A sequence may appear with several positions, also while swapped out. Full
        computed blocks whose token ids are now all known get their prefix-cache keys here, at
        once; blocks not computed yet get them at the ``mark_computed`` that completes them.

        Raises:
          ValueError: unknown sequence, lengths that differ, a position out of range or of a slot
            whose token id is known, a repeated pair, a bad token id (before any state change).
        """
        self._progress.set_tokens(seq_ids, positions, token_ids)
        if self.debug:
            self.check_invariants()

    def mark_computed_many(self, seq_ids: Sequence, num_computed_tokens: Sequence[int]) -> None:
        """``mark_computed(seq_ids[i], num_computed_tokens[i])`` for every i, in one call.

        Raises:
          ValueError: as ``mark_computed`` would for any pair, or for repeated ids, before any
            state change.
        """
        self._progress.mark_computed_many(seq_ids, num_computed_tokens)
        if self._window is not None:
            self._window.recycle(seq_ids)
            self._end_call()
        elif self.debug:
            self.check_invariants()

    def reserve_lookahead(self, seq_id, k: int, token_ids: Sequence[int] | None = None
                          ) -> list[tuple[int, int]] | None:
        """Reserves ``k`` speculative slots (draft tokens ``token_ids`` if known, for caching).

        Blocks holding lookahead slots of unknown token id are never keyed.

        Returns:
          CoW pairs, or ``None`` if out of blocks (nothing changed).
        """
        pairs = self._tables.reserve_lookahead(seq_id, k, token_ids)
        self._end_call()
        return pairs

    def rollback(self, seq_id, r: int) -> None:
        """Drops the last ``r`` slots of ``seq_id``; blocks left empty are freed (tail first).

        Raises:
          ValueError: unknown or swapped-out ``seq_id``, or ``r`` larger than the sequence.
        """
        self._tables.rollback(seq_id, r)
        self._end_call()

    def mark_computed(self, seq_id, num_computed_tokens: int) -> None:
        """Records that KV for the first ``num_computed_tokens`` slots is on device (after the step
        that wrote it); full blocks among them get their prefix-cache keys now, never earlier (and
        never while one of their token ids is unknown).

        Raises:
          ValueError: unknown or swapped-out ``seq_id``; a count that decreases or exceeds the
            slots.
        """
        self._progress.mark_computed(seq_id, num_computed_tokens)
        if self._window is not None:
            self._window.recycle((seq_id,))
            self._end_call()
        elif self.debug:
            self.check_invariants()

    def fork(self, parent_seq_id, child_seq_id) -> None:
        """Makes ``child_seq_id`` share every block of ``parent_seq_id`` (refcount + 1 each).

        Raises:
          ValueError: unknown/swapped parent, existing child, or a parent with slots not yet
            computed (both would write the same shared block).
        """
        self._tables.fork(parent_seq_id, child_seq_id)
        self._end_call()

    def free(self, seq_id) -> None:
        """Releases ``seq_id``: its blocks (tail first, so tail blocks are evicted first) or, if
        swapped out, its host slots. Quarantined while a step that may read them is in flight."""
        self._tables.remove(seq_id)
        if self._tier is not None:
            self._tier.forget(seq_id)
        self._end_call()

    def compact(self, seq_id, keep: int) -> Compaction | None:
        """A KV policy keeps ``keep`` slots of ``seq_id``: its private blocks shrink to hold
        them, the rest go back to the pool (`paged.kv.blocks.compact`); the returned plan is what
        the device must move (``None``: nothing changed)."""
        plan = compact(self._tables, seq_id, count_arg(keep, "keep"))
        if plan is not None:
            self.compacted_blocks += plan.freed
        self._end_call()
        return plan

    def evict_cached(self, num_blocks: int | None = None) -> int:
        """Drops up to ``num_blocks`` (default all) cached blocks to the free list, in the eviction
        order (LRU first by default)."""
        lru = self._pool.lru
        n = len(lru) if num_blocks is None else min(count_arg(num_blocks, "num_blocks"), len(lru))
        self._pool.evict(n)
        if self._events is not None and not len(self._index) and (
                self._tier is None or not len(self._tier.index)):
            self._events.cleared()  # vLLM's reset_prefix_cache event (the removals came first)
        self._end_call()
        return n

    def set_event_sink(self, sink) -> None:
        """Reports every prefix-cache key stored or removed from now on to ``sink`` (a
        `paged.kv.events.KVEventSink`; the keys held now first, as stored), the host tier's as
        medium ``"CPU"``; ``None`` stops reporting."""
        self._events = sink
        if sink is not None:
            events.snapshot(self._index, sink.medium(events.MEDIUM_DEVICE))
            if self._tier is not None:
                events.snapshot(self._tier.index, sink.medium(events.MEDIUM_HOST))
        self._wire_listeners()

    def _wire_listeners(self) -> None:
        """Each index's listeners: its residency figures, then the event sink."""
        res, sink = self._residency or (None, None), self._events
        tiers = [(self._index, res[0], events.MEDIUM_DEVICE)]
        if self._tier is not None:
            tiers.append((self._tier.index, res[1], events.MEDIUM_HOST))
        for index, residency, medium in tiers:
            index.events = listeners([residency, None if sink is None else sink.medium(medium)])

    def set_time(self, now: float) -> None:
        """The clock (the host step's ``now``, HostCore.begin) of the eviction order's retention
        times (`PolicyCalls.set_time`) and of the residency figures."""
        PolicyCalls.set_time(self, now)
        if self._residency is not None:
            for r in self._residency:
                if r is not None:
                    r.now = now

    def residency_stats(self) -> dict:
        """``{"device": ..., "host": ...}``: each tier's `Residency.as_dict` (a tier that does
        not exist, or a KV-cache group's manager: absent)."""
        res = self._residency or (None, None)
        return {name: r.as_dict() for name, r in zip(("device", "host"), res) if r is not None}

    # --- debug -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Checks the whole state in O(pool + table entries).

        Raises:
          AssertionError: with a message naming the first violation found.
        """
        check_invariants(self._pool, self._fence, self._index, self._tables)
        if self._tier is not None:
            self._tier.check()
            for seq_id in self._tier.loading:
                if seq_id not in self._tables.seqs:
                    raise AssertionError(f"BlockManager invariant violated: loading sequence "
                                         f"{seq_id!r} is not resident")
