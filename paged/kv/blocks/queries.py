"""The read-only half of `BlockManager`'s interface: counts, per-sequence and per-block views,
stats, the block usage the accounting reads, and the prefix-cache probes a router asks.

Nothing here changes state (no pool, admission memo or counter). `ManagerQueries` is mixed into
`paged.kv.block_manager.BlockManager` and reads the parts that class composes (annotated below).
"""

from __future__ import annotations

from collections.abc import Sequence

from paged.kv.blocks.admission import Admission, as_salt
from paged.kv.blocks.fence import StepFence
from paged.kv.blocks.host_tier import HostTier
from paged.kv.blocks.pool import STATE_NAMES, BlockPool
from paged.kv.blocks.prefix_index import BlockKey, PrefixCacheIndex, PrefixKeyer
from paged.kv.blocks.swap import Swapper
from paged.kv.blocks.tables import SeqTables
from paged.kv.blocks.window import WindowRecycler


class ManagerQueries:
    """Queries of one KV-cache group's manager over the parts it composes."""

    # The parts and settings the owning manager sets in its ``__init__``.
    num_blocks: int
    block_size: int
    num_host_blocks: int
    cache_salt: bytes
    _pool: BlockPool
    _fence: StepFence
    _index: PrefixCacheIndex
    _keyer: PrefixKeyer
    _tables: SeqTables
    _admission: Admission
    _swap: Swapper
    _window: WindowRecycler | None
    _tier: HostTier | None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no content, reusable now (excludes cached and quarantined blocks)."""
        return len(self._pool.free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with refcount 0 whose content is cached (evictable, so also allocatable)."""
        return len(self._pool.lru)

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks an allocation may take now: free plus evictable cached."""
        return self._pool.num_allocatable

    @property
    def num_quarantined_blocks(self) -> int:
        return self._pool.num_held

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_used

    @property
    def num_indexed_blocks(self) -> int:
        """Blocks with a prefix-cache key: cached, used or quarantined."""
        return len(self._index)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._fence.host_free)

    def has_seq(self, seq_id) -> bool:
        return seq_id in self._tables.seqs

    def is_swapped(self, seq_id) -> bool:
        return self._tables.get(seq_id).host_table is not None

    def num_tokens(self, seq_id) -> int:
        """Slots of ``seq_id``: prompt, appended and lookahead tokens."""
        return self._tables.get(seq_id).num_tokens

    def num_computed_tokens(self, seq_id) -> int:
        return self._tables.get(seq_id).num_computed

    def block_table(self, seq_id) -> list[int]:
        """A copy of the block table of a resident sequence (ValueError if swapped out)."""
        return list(self._tables.resident(seq_id).table)

    def host_block_table(self, seq_id) -> list[int]:
        """A copy of the host slots of a swapped-out sequence."""
        seq = self._tables.get(seq_id)
        if seq.host_table is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        return list(seq.host_table)

    def refcount(self, block: int) -> int:
        return self._pool.rc[block]

    def block_state(self, block: int) -> str:
        """'free', 'cached', 'used', 'quarantined' or 'null'."""
        return STATE_NAMES[self._pool.state[block]]

    def block_version(self, block: int) -> int:
        return self._pool.version[block]

    def block_key(self, block: int) -> BlockKey | None:
        """The prefix-cache key ``block`` is indexed under, if any."""
        return self._index.key[block]

    def prefix_cache_digests(self) -> tuple[list, list]:
        """``(device, host)``: the digest of every key the device index and the host tier's
        index hold now (what KV events describe, `paged.kv.events`)."""
        parts = [self._index] + ([] if self._tier is None else [self._tier.index])
        out = [[index.key[b].digest for b in index.blocks()] for index in parts]
        return out[0], out[1] if len(out) > 1 else []

    def seq_ids(self) -> list:
        return list(self._tables.seqs)

    def evictable_blocks(self) -> list[int]:
        """Cached refcount-0 blocks in eviction order (next to be evicted first)."""
        return list(self._pool.lru)

    def stats(self) -> dict:
        """Counters since construction plus the current pool split (all ints)."""
        pool, fence = self._pool, self._fence
        return dict(
            self._admission.stats, cow_copies=self._tables.cow_copies,
            quarantined=fence.quarantined, revived=pool.revived,
            swapped_out_blocks=self._swap.swapped_out_blocks,
            swapped_in_blocks=self._swap.swapped_in_blocks,
            evictions=pool.evictions, peak_used_blocks=pool.peak_used,
            num_blocks=self.num_blocks, block_size=self.block_size,
            num_free_blocks=len(pool.free), num_cached_blocks=len(pool.lru),
            num_used_blocks=pool.num_used, num_quarantined_blocks=pool.num_held,
            num_indexed_blocks=len(self._index), num_seqs=len(self._tables.seqs),
            num_host_blocks=self.num_host_blocks, num_free_host_blocks=len(fence.host_free),
            num_quarantined_host_blocks=fence.num_host_held,
            max_blocks_per_sequence=self._tables.max_blocks(),
            recycled_blocks=0 if self._window is None else self._window.recycled_blocks)


    def block_usage(self, *, excluding: Sequence = ()) -> list[tuple[int, int]]:
        """(refcount, filled token slots) of every used block, by block id; O(table entries).

        A shared block counts the most slots any of its sequences fills. ``excluding``: sequence
        ids whose blocks are left out unless another sequence holds them too (blocks held for a
        hand-over, counted apart: ``num_blocks_only_in``).
        """
        return self._tables.block_usage(frozenset(excluding))

    def num_blocks_only_in(self, seq_ids: Sequence) -> int:
        """Blocks that only the sequences ``seq_ids`` hold (no other sequence shares them)."""
        return len(self._tables.blocks_only_in(frozenset(seq_ids))) if seq_ids else 0

    def cached_prefix_tokens(self, token_ids: Sequence[int], *,
                             cache_salt: bytes | str | None = None, probe=None) -> int:
        """Leading tokens of ``token_ids`` the prefix cache holds now: a multiple of the block
        size, never the block holding the final token (as admission counts hits). No side
        effects: no pool state, admission memo or counter changes (a router's query).

        Args:
          token_ids: a prompt's token ids.
          cache_salt: the salt of the prompt's keys (``None``: the manager's own).
          probe: a ``paged.kv.blocks.probe.PrefixProbe`` of the same prompt, to hash it once across
            several managers.
        """
        salt = self.cache_salt if cache_salt is None else as_salt(cache_salt)
        return len(self._keyer.match(token_ids, salt, probe)) * self.block_size

    def prefix_hits(self, token_ids: Sequence[int], *,
                    cache_salt: bytes | str | None = None) -> list[int]:
        """The blocks admission would serve ``token_ids``'s leading blocks from now (as
        ``cached_prefix_tokens`` counts them). No side effects."""
        salt = self.cache_salt if cache_salt is None else as_salt(cache_salt)
        return [b for b, _ in self._keyer.match(token_ids, salt)]

    def tiered_prefix_tokens(self, token_ids: Sequence[int], *,
                             cache_salt: bytes | str | None = None, probe=None
                             ) -> tuple[int, int]:
        """``(device, host)``: leading tokens of ``token_ids`` the device prefix cache holds,
        and the tokens after them the host tier holds (as admission counts hits). Read only."""
        salt = self.cache_salt if cache_salt is None else as_salt(cache_salt)
        hits = self._keyer.match(token_ids, salt, probe)
        host = [] if self._tier is None else self._tier.match(list(token_ids), salt, hits)
        return len(hits) * self.block_size, len(host) * self.block_size
