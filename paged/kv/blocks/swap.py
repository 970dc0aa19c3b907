"""Swap: moving a sequence's blocks to host slots for preemption, and back into fresh blocks.

The copies run in the next device step. Device pages and host slots a copy touches are held by the
step fence until that step completes; a sequence swapped in (out) since the last ``begin_step``
cannot be swapped out (in) again before its copy ran.
"""

from __future__ import annotations

from paged.kv.blocks.fence import StepFence
from paged.kv.blocks.pool import BlockPool
from paged.kv.blocks.tables import SeqTables
from paged.kv.paging import NULL_PAGE


class Swapper:
    """``swap_out``, ``can_swap_in`` and ``swap_in``, with their counters."""

    def __init__(self, pool: BlockPool, fence: StepFence, tables: SeqTables):
        self.pool, self.fence, self.tables = pool, fence, tables
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    def swap_out(self, seq_id) -> list[tuple[int, int]] | None:
        seq = self.tables.resident(seq_id)
        fence = self.fence
        live = seq.table[seq.front:]  # recycled leading entries (a sliding window) stay behind
        if seq.swap_in_step == fence.last_begun + 1 or len(live) > len(fence.host_free):
            return None
        self.tables.note_peak(seq)
        hosts = fence.take_host(len(live))
        seq.swap_out_step = fence.hold_for_copy(live, hosts)
        # A CoW destination of the coming step is not filled yet: read its source (held,
        # unchanged until the step's writes), so the copies may run in any order.
        cow_src = fence.cow_src
        pairs = [(cow_src.get(b, b), h) for b, h in zip(live, hosts, strict=True)]
        seq.host_table = hosts
        fence.release(reversed(live))
        seq.table = []
        seq.dirty_tail = False
        seq.room = None
        seq.key_at = -1
        self.swapped_out_blocks += len(pairs)
        return pairs

    def can_swap_in(self, seq_id) -> bool:
        seq = self.tables.get(seq_id)
        if seq.host_table is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        return (seq.swap_out_step != self.fence.last_begun + 1
                and len(seq.host_table) <= self.pool.num_allocatable)

    def swap_in(self, seq_id) -> list[tuple[int, int]] | None:
        if not self.can_swap_in(seq_id):
            return None
        seq = self.tables.seqs[seq_id]
        fresh = self.pool.take(len(seq.host_table))
        pairs = list(zip(seq.host_table, fresh, strict=True))
        seq.swap_in_step = self.fence.hold_for_copy(fresh, seq.host_table)
        self.fence.release_host(seq.host_table)
        seq.host_table = None
        seq.table = [NULL_PAGE] * seq.front + fresh
        seq.keys = []  # re-keyed (and deduplicated) once the swap-in copy has run
        self.tables.fast_state(seq)
        self.swapped_in_blocks += len(pairs)
        return pairs
