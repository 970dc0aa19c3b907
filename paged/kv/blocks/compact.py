"""Compaction of one sequence's slots after a KV policy dropped tokens (the host's half).

A KV policy keeps ``keep`` slots of a sequence's ``n``; the device moves the survivors into the
first slots of the sequence's *private* blocks (`paged.engine.kv_compact`) and this module
updates the block table to match, the same step:

- Blocks shared with another sequence (a prefix-cache hit, a fork) are never rewritten: sharing
  is always a leading run of blocks, so the compacted region starts after the last shared block
  and the shared blocks stay whole (their tokens all survive; they count toward the budget).
- The region's first ``ceil(kept / block_size)`` blocks are rewritten in place: each leaves the
  prefix-cache index (its content changes) and changes version. The region's other blocks go
  back to the pool at once (through the step fence, so a step in flight may still read them);
  their content is untouched, so a block still keyed stays a valid prefix-cache entry.
- The sequence is marked ``nokey``: its slots no longer hold one position each, so none of its
  blocks is keyed again (a compacted block is never a prefix-cache hit for another sequence).
"""

from __future__ import annotations

from typing import NamedTuple

from paged.kv.blocks.tables import SeqTables


class Compaction(NamedTuple):
    """What the device must do for one sequence: read the ``region`` pages (slots
    ``first_block * block_size ..`` of the sequence, ``num_region`` of them real) and write the
    ``num_kept`` survivors of every (layer, KV head) into their first slots, in the same pages."""

    region: list[int]  # pages of the compacted region, in table order (read all, write the first)
    first_block: int  # table index of the region's first block (blocks before it are shared)
    num_region: int  # slots of the region before
    num_kept: int  # slots of the region after
    freed: int  # blocks that left the table


def compact(tables: SeqTables, seq_id, keep: int) -> Compaction | None:
    """Keeps ``keep`` slots of resident ``seq_id`` (at least every shared one and one more).
    Every slot must be written by a step already dispatched (the caller's rule: the device
    orders the compaction after those steps). Returns ``None`` (nothing changed) when nothing
    would be dropped, a slot's token id is unknown yet, or it has no private block."""
    seq = tables.resident(seq_id)
    n, B = seq.num_tokens, tables.block_size
    if seq.unknown or seq.front:
        return None
    rc, table = tables.pool.rc, seq.table
    first = 0
    for i, b in enumerate(table):
        if rc[b] > 1:
            first = i + 1
    s0 = first * B
    if s0 >= n:
        return None
    kept = max(keep - s0, 1)
    if kept >= n - s0:
        return None
    new_n = s0 + kept
    new_blocks = -(-new_n // B)
    region = table[first:]
    index, version = tables.index, tables.pool.version
    for b in table[first:new_blocks]:  # rewritten in place: the old content dies
        key = index.key[b]
        if key is not None:
            index.remove(b, key.digest)
        version[b] += 1
    freed = table[new_blocks:]
    del table[new_blocks:]
    tables.rows.truncate(seq.row, new_n)
    del seq.keys[first:]
    seq.num_computed = new_n
    seq.nokey = True
    seq.dirty_tail = False
    tables.batches = []
    tables.fast_state(seq)
    tables.fence.release(reversed(freed))
    return Compaction(region, first, n - s0, kept, len(freed))


__all__ = ["Compaction", "compact"]
