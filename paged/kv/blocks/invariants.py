"""The whole-state check of the block manager's parts, O(pool + table entries)."""

from __future__ import annotations

from collections.abc import Sequence

from paged.kv.blocks.fence import StepFence
from paged.kv.blocks.pool import (
    CACHED,
    FREE,
    NULL,
    QUARANTINED,
    STATE_NAMES,
    USED,
    BlockPool,
)
from paged.kv.blocks.prefix_index import PrefixCacheIndex, keys_equal
from paged.kv.blocks.tables import SeqTables
from paged.kv.blocks.token_rows import UNKNOWN_ID
from paged.kv.paging import NULL_PAGE


def fail(msg: str):
    raise AssertionError(f"BlockManager invariant violated: {msg}")


def check_invariants(pool: BlockPool, fence: StepFence, index: PrefixCacheIndex,
                     tables: SeqTables | Sequence[SeqTables]) -> None:
    """Raises AssertionError with a message naming the first violation found.

    ``tables``: the sequence tables of the pool, or one per KV-cache group sharing it (a block's
    refcount then counts the references of every group)."""
    groups = (tables,) if isinstance(tables, SeqTables) else tuple(tables)
    refs = [0] * pool.num_blocks
    for group in groups:
        for b, r in enumerate(_check_seqs(pool, index, group)):
            refs[b] += r
    _check_blocks(pool, fence, index, refs)
    index.check(pool.version)
    _check_host(fence, groups)


def _check_seqs(pool: BlockPool, index: PrefixCacheIndex, tables: SeqTables) -> list[int]:
    """Checks every sequence; returns the table references of every block."""
    nb, B = pool.num_blocks, tables.block_size
    refs = [0] * nb
    rows = tables.rows
    live = {seq.row for seq in tables.seqs.values()}
    if len(live) != len(tables.seqs) or live & set(rows.free) or (
            len(live) + len(rows.free) != rows.capacity):
        fail(f"token rows: {len(tables.seqs)} sequences hold rows {sorted(live)}, free "
             f"{sorted(rows.free)} of {rows.capacity}")
    for sid, seq in tables.seqs.items():
        tokens = seq.tokens
        if seq.num_computed > len(tokens) or len(seq.keys) > seq.num_computed // B:
            fail(f"seq {sid!r}: computed={seq.num_computed} keys={len(seq.keys)} "
                 f"tokens={len(tokens)}")
        held = int((rows.tok[seq.row, :len(tokens)] == UNKNOWN_ID).sum())
        if seq.unknown != held:
            fail(f"seq {sid!r} counts {seq.unknown} slots of unknown token id, holds {held}")
        if seq.host_table is not None:
            if seq.table or len(seq.host_table) != -(-len(tokens) // B) - seq.front:
                fail(f"swapped seq {sid!r} table={seq.table} host={seq.host_table}")
            continue
        if len(seq.table) != -(-len(tokens) // B):
            fail(f"seq {sid!r} has {len(seq.table)} blocks for {len(tokens)} tokens")
        if seq.room is not None and (
                seq.room != -len(tokens) % B or seq.room and (
                    pool.rc[seq.table[-1]] != 1 or seq.dirty_tail
                    or index.key[seq.table[-1]] is not None)):
            fail(f"seq {sid!r} may append {seq.room} slots in place into a tail block that is "
                 f"shared, keyed or dirty, or has a different number of free slots")
        if seq.key_at > (len(seq.keys) + 1) * B and tables.caching and not seq.nokey:
            fail(f"seq {sid!r} skips keying up to {seq.key_at} tokens with {len(seq.keys)} keys")
        if seq.front and any(b != NULL_PAGE for b in seq.table[:seq.front]):
            fail(f"seq {sid!r} recycled {seq.front} leading blocks, table {seq.table}")
        for i, b in enumerate(seq.table[seq.front:], start=seq.front):
            if not 0 <= b < nb or b == NULL_PAGE:
                fail(f"seq {sid!r} block {i} is {b}")
            if pool.state[b] != USED:
                fail(f"seq {sid!r} references block {b} in state {STATE_NAMES[pool.state[b]]}")
            refs[b] += 1
        for i, key in enumerate(seq.keys):
            if key.token_ids != tuple(tokens[i * B:(i + 1) * B]) or key.salt != seq.salt:
                fail(f"seq {sid!r} key {i} does not match its tokens")
            if not keys_equal(key.parent, seq.keys[i - 1] if i else None):
                fail(f"seq {sid!r} key {i} has the wrong parent")
    return refs


def _check_blocks(pool: BlockPool, fence: StepFence, index: PrefixCacheIndex,
                  refs: list[int]) -> None:
    """Checks each block's state against the free queue, LRU, quarantine and references."""
    rc, state = pool.rc, pool.state
    if state[NULL_PAGE] != NULL or rc[NULL_PAGE] != 0:
        fail(f"NULL_PAGE has state {STATE_NAMES[state[NULL_PAGE]]}, refcount {rc[NULL_PAGE]}")
    free_set = set(pool.free)
    if len(free_set) != len(pool.free):
        fail("duplicate block in the free list")
    held = {b for r, bs in fence.held.items() for b in bs
            if state[b] == QUARANTINED and fence.release_at[b] == r}
    done = fence.last_completed
    counts = [0] * 5
    for b in range(pool.num_blocks):
        st = state[b]
        counts[st] += 1
        if b == NULL_PAGE:
            continue
        name = STATE_NAMES[st]
        if refs[b] != rc[b]:
            fail(f"block {b} refcount {rc[b]} != {refs[b]} table references")
        if (st == USED) != (rc[b] > 0):
            fail(f"block {b} in state {name} has refcount {rc[b]}")
        if (b in free_set) != (st == FREE) or (b in pool.lru) != (st == CACHED):
            fail(f"block {b} state {name} disagrees with free list / LRU")
        if (b in held) != (st == QUARANTINED):
            fail(f"block {b} state {name} disagrees with the quarantine")
        if st == QUARANTINED and fence.release_at[b] <= done:
            fail(f"block {b} still quarantined after step {fence.release_at[b]} completed")
        keyed = index.key[b] is not None
        if st == FREE and keyed or st == CACHED and not keyed:
            fail(f"block {b} in state {name} has key={keyed}")
        if st in (FREE, CACHED) and fence.busy_until[b] > done:
            fail(f"reusable block {b} has a copy pending in step {fence.busy_until[b]}")
        if fence.busy_until[b] > fence.copy_step:
            fail(f"block {b} has a copy in step {fence.busy_until[b]} after the latest "
                 f"copy step {fence.copy_step}")
        if st == CACHED and pool.lru[b] != index.key[b].digest:
            fail(f"cached block {b} waits in the LRU under digest {pool.lru[b]!r}, "
                 f"not its key's")
    if (counts[FREE], counts[CACHED], counts[USED], counts[QUARANTINED]) != (
            len(pool.free), len(pool.lru), pool.num_used, pool.num_held):
        fail(f"state counts {counts} vs free={len(pool.free)} lru={len(pool.lru)} "
             f"used={pool.num_used} held={pool.num_held}")
    if sum(counts) != pool.num_blocks:
        fail(f"state counts {counts} do not sum to {pool.num_blocks}")


def _check_host(fence: StepFence, groups: Sequence[SeqTables]) -> None:
    """Host slots are partitioned between the free list, the quarantine and swapped sequences."""
    host = list(fence.host_free) + [h for hs in fence.host_held.values() for h in hs]
    if len(host) != len(fence.host_free) + fence.num_host_held:
        fail("host quarantine count is off")
    for tables in groups:
        for seq in tables.seqs.values():
            if seq.host_table is not None:
                host += seq.host_table
    if sorted(host) != list(range(fence.num_host_blocks)):
        fail(f"host slots are not partitioned: {sorted(host)}")
