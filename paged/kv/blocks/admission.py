"""Admission of a new prompt: prefix lookup, capacity check, the new sequence's block table.

A prompt is hashed once per admission: ``can_allocate`` remembers its validated tokens and prefix
hits, and the ``allocate`` of the same tokens and salt that follows reuses them as long as the
prefix-cache index has not changed since (any change invalidates them; capacity is always
rechecked against the pool as it is).
"""

from __future__ import annotations

from collections.abc import Sequence

from paged.kv.blocks.host_tier import HostTier
from paged.kv.blocks.pool import CACHED, BlockPool
from paged.kv.blocks.prefix_index import BlockKey, PrefixKeyer
from paged.kv.blocks.tables import SeqTables, token_list


def as_salt(salt: bytes | str) -> bytes:
    if isinstance(salt, str):
        return salt.encode()
    if isinstance(salt, bytes | bytearray):
        return bytes(salt)
    raise ValueError(f"cache_salt={salt!r} must be bytes or str")


class Admission:
    """``can_allocate`` and ``allocate``, with their counters.

    Args:
      pool, keyer, tables: the block pool, prefix keyer and sequence tables.
      cache_salt: the default salt of every key.
      tier: the host tier, or ``None``. With one, the blocks after the device's hits that the
        tier holds are hits too: they take fresh device blocks (as misses would, so capacity is
        checked as without a tier) and are loaded into them by the coming step.
    """

    def __init__(self, pool: BlockPool, keyer: PrefixKeyer, tables: SeqTables, cache_salt: bytes,
                 tier: HostTier | None = None):
        self.pool, self.keyer, self.tables, self.tier = pool, keyer, tables, tier
        self.cache_salt = cache_salt
        # (tokens, salt, index generation, hits) of the last can_allocate; tokens are ours.
        self._memo: tuple[list[int], bytes, int, list[tuple[int, BlockKey]]] | None = None
        self.stats = {"hits": 0, "misses": 0, "hit_tokens": 0, "query_tokens": 0,
                      "allocations": 0, "failed_allocations": 0}
        # (tokens, salt, device hits) of each admission, or None (`BlockManager.record_accesses`)
        self.on_access = None
        # (device, host or None) `paged.kv.blocks.residency.Residency` told of each admission.
        self.residency = None

    def _match(self, prompt_token_ids: Sequence[int], cache_salt
               ) -> tuple[list[int], bytes, list[tuple[int, BlockKey]]]:
        """Validated tokens, salt and prefix hits of a prompt (the memo's when it still holds)."""
        salt = self.cache_salt if cache_salt is None else as_salt(cache_salt)
        memo = self._memo
        if memo is not None:
            self._memo = None
            if (memo[2] == self.keyer.index.generation and memo[1] == salt
                    and type(prompt_token_ids) is list and memo[0] == prompt_token_ids):
                return memo[0], salt, memo[3]
        tokens = token_list(prompt_token_ids, "prompt_token_ids")
        if not tokens:
            raise ValueError("prompt_token_ids must not be empty")
        return tokens, salt, self.keyer.match(tokens, salt)

    def _fits(self, n: int, hits) -> tuple[int, bool]:
        """Fresh blocks the prompt needs, and whether the pool has them besides the hits."""
        need = -(-n // self.keyer.block_size) - len(hits)
        state = self.pool.state
        revived = sum(1 for b, _ in hits if state[b] == CACHED)
        return need, need <= self.pool.num_allocatable - revived

    def can_allocate(self, prompt_token_ids: Sequence[int], cache_salt) -> bool:
        tokens, salt, hits = self._match(prompt_token_ids, cache_salt)
        self._memo = (tokens, salt, self.keyer.index.generation, hits)
        return self._fits(len(tokens), hits)[1]

    def allocate(self, seq_id, prompt_token_ids: Sequence[int], cache_salt,
                 max_hits: int | None = None) -> int | None:
        """``max_hits``: use at most this many leading hits (the hit every KV-cache group of
        the sequence has, `paged.kv.group_manager`); None: all."""
        if seq_id in self.tables.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens, salt, hits = self._match(prompt_token_ids, cache_salt)
        if max_hits is not None and len(hits) > max_hits:
            hits = hits[:max_hits]
        need, fits = self._fits(len(tokens), hits)
        st = self.stats
        if not fits:
            st["failed_allocations"] += 1
            self._memo = (tokens, salt, self.keyer.index.generation, hits)  # nothing changed
            return None
        pool, tier, B = self.pool, self.tier, self.keyer.block_size
        host = [] if tier is None else tier.match(tokens, salt, hits)
        for b, _ in hits:  # revive before taking fresh blocks: never evict what we are about to hit
            pool.acquire(b)
        if host:
            tier.hold(host)  # likewise: taking blocks spills to the tier, which must keep these
        table = [b for b, _ in hits] + pool.take(need)
        num_hit = (len(hits) + len(host)) * B
        self.tables.add(seq_id, table, tokens, hits, salt, num_computed=num_hit)
        if host:
            tier.load(seq_id, host, table[len(hits):len(hits) + len(host)])
        st["allocations"] += 1
        if self.on_access is not None:
            self.on_access(tokens, salt, len(hits))
        if self.keyer.enabled:
            st["hits"] += len(hits) + len(host)
            st["misses"] += (len(tokens) - 1) // B - len(hits) - len(host)
            st["hit_tokens"] += num_hit
            st["query_tokens"] += len(tokens)
            if self.residency is not None:
                self._observe(tokens, salt, hits, host)
        return num_hit

    def _observe(self, tokens: list[int], salt: bytes, hits, host) -> None:
        """Tells the residency figures of one admission: the keys hit in each tier and the
        tokens asked and hit (no hashing: regret is found when a removed key is stored again)."""
        device, tier = self.residency
        B = self.keyer.block_size
        for b, _ in hits:
            device.hit(b)
        device.queried(len(tokens), len(hits) * B)
        if tier is not None:
            for slot, key in host:
                tier.hit(slot)
                device.forgive(key.digest)  # loaded from the host: no recompute, no regret
            tier.queried(len(tokens) - len(hits) * B, len(host) * B)
