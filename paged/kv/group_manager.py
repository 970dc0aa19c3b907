"""`GroupedBlockManager`: one block table per KV-cache group for each sequence, one pool.

A model with full and sliding layers (`paged.kv.groups`) keeps, for each sequence, one
block table per attention kind. Each group is an ordinary `BlockManager` (its sequence tables,
admission, progress and, for the sliding group, its `WindowRecycler`) built over the parts every
group shares (`SharedParts`: one `BlockPool`, one `StepFence`, one `PrefixCacheIndex`). This
facade answers the block manager's interface by asking every group, and owns the decisions
that must be taken once for all of them:

* **Capacity.** A call that takes blocks (admission, decode append, slot append) first adds up
  what every group needs and compares the sum with the pool; only then does each group take its
  blocks. So a request is admitted, or a decode batch grows, only if every group can, and
  nothing is half-allocated: the scheduler preempts (once, for all groups) when it is not.
  The decode check sums each sequence's need, so a tail block shared by several sequences of
  one batch is counted once per sharer (a little conservative, never short).
* **Prefix hits.** Each group has its own keys (the salt names the group), so equal token
  prefixes of two groups are two index entries. A sequence's computed count is one number, so
  admission serves the hit every group has (the shortest of the groups' hits) and pins all of
  those blocks before any group takes fresh ones: one group's allocation never evicts the
  blocks another group is about to revive.
* **Recycling.** The sliding group recycles blocks behind its window after each
  ``mark_computed`` (`paged.kv.blocks.window`); they go back to the shared pool, where the full
  group (or any other sequence) takes them.
* **Block tables for the device.** ``block_table`` interleaves the groups: entry ``G * j + g``
  is group ``g``'s block ``j`` (every group's table has one entry per block of tokens, recycled
  entries being ``NULL_PAGE``), so a batch row is one int32 row and the device takes group
  ``g``'s table as columns ``g::G``.

Swap moves every group's live blocks to one pool of host slots (all or nothing) and back;
speculative lookahead reserves slots in every group after one capacity check, and rollback
drops them in every group. Not built (refused by `paged.config.support`):
a draft model (its KV would need the grouped layout too), the host tier, disaggregated
replicas, ``run_decode_steps``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from paged.kv.block_manager import BlockManager
from paged.kv.blocks.admission import as_salt
from paged.kv.blocks.invariants import check_invariants
from paged.kv.blocks.shared import SharedParts
from paged.kv.blocks.tables import count_arg, token_list
from paged.kv.blocks.token_rows import unknown_as_none
from paged.kv.paging import NULL_PAGE


def group_salt(salt: bytes, group: int) -> bytes:
    """The prefix-cache salt of ``group``'s keys: the same token prefix in two groups holds
    different layers' K/V, so their keys must differ."""
    return salt + b"|kv-group-%d" % group


class GroupedBlockManager:
    """The `BlockManager` interface over one pool shared by KV-cache groups.

    Args:
      num_blocks: physical pages in the pool, counting ``NULL_PAGE``; each page holds one
        group's share of the layers.
      block_size: tokens per block.
      windows: each group's sliding window (None: full attention), in group order.
      enable_prefix_caching, cache_salt, hash_fn, quarantine_steps, num_host_blocks, debug,
        on_free: as `BlockManager`'s (one pool of host slots serves every group's swap).

    Raises:
      ValueError: for a bad argument (fewer than two groups, a window shorter than a block).
    """

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None], *,
                 enable_prefix_caching: bool = True, cache_salt: bytes | str = b"",
                 hash_fn=None, quarantine_steps: int = 1, num_host_blocks: int = 0,
                 debug: bool = False, on_free: Callable[[list[int]], None] | None = None):
        windows = tuple(windows)
        if len(windows) < 2:
            raise ValueError(f"{windows=}: KV-cache groups need at least two kinds of layer")
        self.windows = windows
        self.num_groups = len(windows)
        self.cache_salt = as_salt(cache_salt)
        self.debug = debug
        self.sliding_window = None  # no single window: see ``windows``
        self.num_host_blocks = count_arg(num_host_blocks, "num_host_blocks")
        self.num_host_tier_blocks = 0
        # Groups check nothing on their own (a group's refcounts include the other groups'
        # references); this facade checks the whole pool after each mutating call when debug.
        if count_arg(num_blocks, "num_blocks") < 2:
            raise ValueError(f"{num_blocks=} must be >= 2 (the null page plus one usable block)")
        self._parts = SharedParts.build(num_blocks, quarantine_steps, num_host_blocks, on_free)
        self.groups = [
            BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                         cache_salt=group_salt(self.cache_salt, g), hash_fn=hash_fn,
                         quarantine_steps=quarantine_steps, num_host_blocks=num_host_blocks,
                         on_free=on_free,
                         sliding_window=w, parts=self._parts)
            for g, w in enumerate(windows)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = self.groups[0].enable_prefix_caching
        self.quarantine_steps = quarantine_steps
        self.allocated_hits = 0  # prompt tokens served from the cache (every group's hit)

    def _end_call(self) -> None:
        self._parts.pool.flush()
        if self.debug:
            self.check_invariants()

    # --- steps ----------------------------------------------------------------------------
    def begin_step(self) -> int:
        return self.groups[0].begin_step()  # the shared fence

    def step_completed(self, step_id: int) -> None:
        self.groups[0].step_completed(step_id)
        if self.debug:
            self.check_invariants()

    last_begun_step = property(lambda self: self.groups[0].last_begun_step)
    last_completed_step = property(lambda self: self.groups[0].last_completed_step)

    # --- queries (the pool is shared: any group answers) ----------------------------------
    num_free_blocks = property(lambda self: self.groups[0].num_free_blocks)
    num_cached_blocks = property(lambda self: self.groups[0].num_cached_blocks)
    num_allocatable_blocks = property(lambda self: self.groups[0].num_allocatable_blocks)
    num_quarantined_blocks = property(lambda self: self.groups[0].num_quarantined_blocks)
    num_used_blocks = property(lambda self: self.groups[0].num_used_blocks)
    num_indexed_blocks = property(lambda self: self.groups[0].num_indexed_blocks)
    num_free_host_blocks = property(lambda self: self.groups[0].num_free_host_blocks)

    # --- eviction: a grouped pool evicts LRU only (paged.config.support refuses the others) ---
    eviction_policy = "lru"
    eviction_feed = None

    def set_retention(self, seq_id, priority: int, until: float | None) -> None:
        for g in self.groups:
            g.set_retention(seq_id, priority, until)

    def has_seq(self, seq_id) -> bool:
        return self.groups[0].has_seq(seq_id)

    def is_swapped(self, seq_id) -> bool:
        return self.groups[0].is_swapped(seq_id)

    def num_tokens(self, seq_id) -> int:
        return self.groups[0].num_tokens(seq_id)

    def num_computed_tokens(self, seq_id) -> int:
        return self.groups[0].num_computed_tokens(seq_id)

    def group_block_table(self, group: int, seq_id) -> list[int]:
        """A copy of ``group``'s block table of a resident sequence."""
        return self.groups[group].block_table(seq_id)

    def block_table(self, seq_id) -> list[int]:
        """The groups' tables interleaved: entry ``G * j + g`` is group ``g``'s block ``j``."""
        tables = [g.block_table(seq_id) for g in self.groups]
        return [b for column in zip(*tables, strict=True) for b in column]

    def refcount(self, block: int) -> int:
        return self.groups[0].refcount(block)

    def block_state(self, block: int) -> str:
        return self.groups[0].block_state(block)

    def block_group(self, block: int) -> int | None:
        """The group whose tables reference ``block`` now (None: no sequence holds it)."""
        for g, group in enumerate(self.groups):
            if any(block in group.block_table(s) for s in group.seq_ids()
                   if not group.is_swapped(s)):
                return g
        return None

    def seq_ids(self) -> list:
        return self.groups[0].seq_ids()

    def evictable_blocks(self) -> list[int]:
        return self.groups[0].evictable_blocks()

    def stats(self) -> dict:
        """`BlockManager.stats` of the pool (shared counters from any group), with per-group
        figures summed (``cow_copies``, ``recycled_blocks``, ``max_blocks_per_sequence``: the
        sum of each group's most) and listed under ``groups``."""
        per = [g.stats() for g in self.groups]
        out = dict(per[0])
        for k in ("cow_copies", "recycled_blocks", "max_blocks_per_sequence",
                  "swapped_out_blocks", "swapped_in_blocks"):
            out[k] = sum(p[k] for p in per)
        out["groups"] = [
            {"window": w, "max_blocks_per_sequence": p["max_blocks_per_sequence"],
             "recycled_blocks": p["recycled_blocks"], "cow_copies": p["cow_copies"],
             "num_used_blocks": sum(1 for _ in g.block_usage())}
            for w, p, g in zip(self.windows, per, self.groups)]
        return out

    def take_recycled_seqs(self) -> set:
        out: set = set()
        for g in self.groups:
            out |= g.take_recycled_seqs()
        return out

    def block_usage(self, *, excluding: Sequence = ()) -> list[tuple[int, int]]:
        """Every group's used blocks (a block belongs to one group at a time)."""
        return [u for g in self.groups for u in g.block_usage(excluding=excluding)]

    def num_blocks_only_in(self, seq_ids: Sequence) -> int:
        return sum(g.num_blocks_only_in(seq_ids) for g in self.groups)

    # --- prefix queries -------------------------------------------------------------------
    def _salt(self, cache_salt) -> bytes:
        return self.cache_salt if cache_salt is None else as_salt(cache_salt)

    def cached_prefix_tokens(self, token_ids: Sequence[int], *, cache_salt=None,
                             probe=None) -> int:
        """The prefix every group holds now (as admission serves it). No side effects."""
        salt = self._salt(cache_salt)
        return min(g.cached_prefix_tokens(token_ids, cache_salt=group_salt(salt, i))
                   for i, g in enumerate(self.groups))

    def tiered_prefix_tokens(self, token_ids: Sequence[int], *, cache_salt=None,
                             probe=None) -> tuple[int, int]:
        return self.cached_prefix_tokens(token_ids, cache_salt=cache_salt), 0

    # --- admission ------------------------------------------------------------------------
    def _plan(self, token_ids: Sequence[int], salt: bytes) -> tuple[int, list[list[int]], int]:
        """``(common hit blocks, each group's hit blocks cut to it, blocks the pool must
        supply)``: fresh blocks of every group plus cached hits that leave the LRU."""
        tokens = token_list(token_ids, "prompt_token_ids")
        hits = [g.prefix_hits(tokens, cache_salt=group_salt(salt, i))
                for i, g in enumerate(self.groups)]
        h = min(len(x) for x in hits)
        hits = [x[:h] for x in hits]
        blocks = -(-len(tokens) // self.block_size)
        cached = sum(1 for x in hits for b in x if self.block_state(b) == "cached")
        return h, hits, self.num_groups * (blocks - h) + cached

    def can_allocate(self, prompt_token_ids: Sequence[int], *, cache_salt=None) -> bool:
        """Whether every group can take the prompt now (no side effects)."""
        _, _, need = self._plan(prompt_token_ids, self._salt(cache_salt))
        return need <= self.num_allocatable_blocks

    def allocate(self, seq_id, prompt_token_ids: Sequence[int], *, cache_salt=None
                 ) -> int | None:
        """Creates ``seq_id`` in every group, or in none (returns None: the pool is short).

        Returns:
          Prompt tokens served from the cache (the hit every group has).

        Raises:
          ValueError: as `BlockManager.allocate` (before any state change).
        """
        if self.has_seq(seq_id):
            raise ValueError(f"sequence {seq_id!r} already exists")
        prompt_token_ids = token_list(prompt_token_ids, "prompt_token_ids")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        salt = self._salt(cache_salt)
        h, hits, need = self._plan(prompt_token_ids, salt)
        if need > self.num_allocatable_blocks:
            return None
        pinned = [b for x in hits for b in x]
        pool, fence = self._parts.pool, self._parts.fence
        for b in pinned:  # revive every group's hits before any group takes fresh blocks
            pool.acquire(b)
        got = [g.allocate(seq_id, prompt_token_ids, cache_salt=group_salt(salt, i),
                          max_hit_blocks=h) for i, g in enumerate(self.groups)]
        fence.release(reversed(pinned))
        if any(x != h * self.block_size for x in got):
            raise AssertionError(f"groups admitted {seq_id!r} with hits {got}, planned {h} blocks")
        self.allocated_hits += got[0]
        self._end_call()
        return got[0]

    # --- growth ---------------------------------------------------------------------------
    def num_slots_needed(self, seq_id, n: int) -> int:
        return sum(g.num_slots_needed(seq_id, n) for g in self.groups)

    def append_slots(self, seq_id, new_token_ids: Sequence[int | None]
                     ) -> list[tuple[int, int]] | None:
        """Every group grows by the slots, or none does (None)."""
        new_token_ids = list(new_token_ids)
        if self.num_slots_needed(seq_id, len(new_token_ids)) > self.num_allocatable_blocks:
            return None
        pairs = []
        for g in self.groups:
            got = g.append_slots(seq_id, new_token_ids)
            if got is None:
                raise AssertionError(f"group short of blocks after the capacity check ({seq_id!r})")
            pairs += got
        self._end_call()
        return pairs

    def append_decode_slots(self, seq_ids: Sequence, token_ids: Sequence[int | None],
                            unknown=None) -> list[tuple[int, int]] | None:
        """One decode slot per sequence in every group, all or nothing."""
        seq_ids, token_ids = list(seq_ids), unknown_as_none(token_ids, unknown)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("repeated sequence ids in the decode batch")
        need = sum(g.num_slots_needed(s, 1) for g in self.groups for s in seq_ids)
        if need > self.num_allocatable_blocks:
            return None
        pairs = []
        for g in self.groups:
            got = g.append_decode_slots(seq_ids, token_ids)
            if got is None:
                raise AssertionError("group short of blocks after the decode capacity check")
            pairs += got
        self._end_call()
        return pairs

    def run_decode_steps(self, seq_ids: Sequence, token_ids) -> bool:
        raise ValueError("run_decode_steps is not built for KV-cache groups (the sliding group "
                         "recycles per step); step instead")

    def reserve_lookahead(self, seq_id, k: int, token_ids: Sequence[int] | None = None
                          ) -> list[tuple[int, int]] | None:
        """``k`` speculative slots in every group, or none (None)."""
        if self.num_slots_needed(seq_id, k) > self.num_allocatable_blocks:
            return None
        pairs = []
        for g in self.groups:
            got = g.reserve_lookahead(seq_id, k, token_ids)
            if got is None:
                raise AssertionError(f"group short of blocks after the capacity check ({seq_id!r})")
            pairs += got
        self._end_call()
        return pairs

    def rollback(self, seq_id, r: int) -> None:
        """Drops the last ``r`` slots in every group (blocks left empty are freed)."""
        for g in self.groups:
            g.rollback(seq_id, r)
        self._end_call()

    # --- progress -------------------------------------------------------------------------
    def set_tokens(self, seq_ids: Sequence, positions: Sequence[int],
                   token_ids: Sequence[int]) -> None:
        for g in self.groups:
            g.set_tokens(seq_ids, positions, token_ids)
        if self.debug:
            self.check_invariants()

    def mark_computed_many(self, seq_ids: Sequence, num_computed_tokens: Sequence[int]) -> None:
        for g in self.groups:
            g.mark_computed_many(seq_ids, num_computed_tokens)
        self._end_call()

    def mark_computed(self, seq_id, num_computed_tokens: int) -> None:
        for g in self.groups:
            g.mark_computed(seq_id, num_computed_tokens)
        self._end_call()

    # --- lifetime -------------------------------------------------------------------------
    def fork(self, parent_seq_id, child_seq_id) -> None:
        for g in self.groups:
            g.fork(parent_seq_id, child_seq_id)
        self._end_call()

    def free(self, seq_id) -> None:
        for g in self.groups:
            g.free(seq_id)
        self._end_call()

    def set_time(self, now: float) -> None:  # a grouped pool keeps no residency figures
        pass

    residency_stats = staticmethod(dict)

    def set_event_sink(self, sink) -> None:
        """``BlockManager.set_event_sink`` on the index every group shares (keys of all groups,
        each salted by its group)."""
        self.groups[0].set_event_sink(sink)

    def evict_cached(self, num_blocks: int | None = None) -> int:
        n = self.groups[0].evict_cached(num_blocks)
        self._end_call()
        return n

    # --- what a grouped pool does not have ------------------------------------------------
    def is_loading(self, seq_id) -> bool:
        return False

    def loading_tokens(self, seq_id) -> int:
        return 0

    def take_tier_copies(self):
        return None

    def host_tier_stats(self) -> dict:
        return {}

    # --- swap -----------------------------------------------------------------------------
    def swap_out(self, seq_id) -> list[tuple[int, int]] | None:
        """Every group's live blocks to host slots (one pool of slots), or none (None: too few
        slots, or swapped in since the last ``begin_step``)."""
        live = sum(1 for b in self.block_table(seq_id) if b != NULL_PAGE)
        if live > self.num_free_host_blocks:
            return None
        pairs = []
        for i, g in enumerate(self.groups):
            got = g.swap_out(seq_id)
            if got is None:
                if i:
                    raise AssertionError(f"group {i} refused to swap out {seq_id!r}")
                return None  # (the same step rule holds for every group: nothing changed)
            pairs += got
        self._end_call()
        return pairs

    def can_swap_in(self, seq_id) -> bool:
        """Whether every group can come back now (the pool holds all of their blocks)."""
        if not all(g.can_swap_in(seq_id) for g in self.groups):
            return False
        need = sum(len(g.host_block_table(seq_id)) for g in self.groups)
        return need <= self.num_allocatable_blocks

    def swap_in(self, seq_id) -> list[tuple[int, int]] | None:
        if not self.can_swap_in(seq_id):
            return None
        pairs = []
        for g in self.groups:
            got = g.swap_in(seq_id)
            if got is None:
                raise AssertionError(f"group short of blocks after the swap-in check ({seq_id!r})")
            pairs += got
        self._end_call()
        return pairs

    def host_block_table(self, seq_id) -> list[int]:
        """Every group's host slots, group after group."""
        return [h for g in self.groups for h in g.host_block_table(seq_id)]

    # --- debug ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The pool against every group's tables; every group has the same sequences with the
        same slots and computed counts; a block is in one group's tables only.

        Raises:
          AssertionError: naming the first violation found.
        """
        parts = self._parts
        check_invariants(parts.pool, parts.fence, parts.index,
                         [g.seq_tables for g in self.groups])
        first = self.groups[0]
        owner: dict[int, int] = {}
        for i, g in enumerate(self.groups):
            if g.seq_ids() != first.seq_ids():
                raise AssertionError(f"group {i} holds sequences {g.seq_ids()}, group 0 "
                                     f"{first.seq_ids()}")
            for s in g.seq_ids():
                if (g.num_tokens(s), g.num_computed_tokens(s)) != (
                        first.num_tokens(s), first.num_computed_tokens(s)):
                    raise AssertionError(f"sequence {s!r}: group {i} and group 0 disagree")
                if g.is_swapped(s):
                    continue
                for b in g.block_table(s):
                    if b != NULL_PAGE and owner.setdefault(b, i) != i:
                        raise AssertionError(f"block {b} is in groups {owner[b]} and {i}")


__all__ = ["GroupedBlockManager", "group_salt"]
