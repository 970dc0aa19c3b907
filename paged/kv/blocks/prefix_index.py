"""Prefix-cache keys, the index from key digest to physical block, and the keying of blocks.

A full block of ``block_size`` tokens is identified by its *key*: the key of the block before it
(``None`` for the first block), the block's own token ids and the cache salt. The salt names
everything besides the tokens that changes the KV content: model, weights version, dtype, adapter,
any run condition. Two blocks may share a physical page only when their keys are equal, which
makes the whole token prefix part of the key, not just the block's tokens. A key stores its token
ids packed (int64 little-endian bytes, the bytes the digest reads): one object per key instead of
a tuple of ``block_size`` ints, so making, comparing and dropping a key touches no int objects.

The index is addressed by the *digest* of a key, from a ``hash_fn`` (never Python's ``hash()``,
which is salted per process). The default, ``xxh3_block_hash``, is the 128-bit XXH3 of (parent
digest, packed token ids, salt): non-cryptographic and about three times cheaper per block than
SHA-256 (``sha256_block_hash``, kept as an option). The index never trusts the digest alone: a
lookup compares the full key (tokens, salt and the whole parent chain), so a digest collision,
accidental or forged, can only cost a hit (the colliding keys share a bucket and each is served
its own block), never return a block with the wrong content. With 128 bits an accidental
collision among n indexed keys has probability about n**2 / 2**129 (below 1e-26 for a billion
blocks); nobody can make the cache serve wrong content by crafting prompts, only, with effort,
slow a bucket down. The tests inject a function that collides on purpose.

Each physical block also carries a content version (kept by the block manager) that changes when
the block is handed out again or its keyed content is rewritten; an index entry remembers the
version it was made at, and a lookup never returns an entry whose version is stale.

``PrefixKeyer`` is the only place that digests blocks: it matches a new prompt's full blocks
against the index and keys a sequence's full computed blocks, both with the one ``hash_fn``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Hashable, Iterable, Sequence

import xxhash

HashFn = Callable[[Hashable | None, tuple[int, ...], bytes], Hashable]
# The same function over a block's packed token ids (``pack_tokens``): what the keyer calls.
PackedHashFn = Callable[[Hashable | None, bytes, bytes], Hashable]

ROOT_DIGEST = bytes(32)  # stands in for the parent digest of a first block (SHA-256)
XXH3_ROOT_DIGEST = bytes(16)  # the same for the default XXH3-128 digest
_sha256 = hashlib.sha256
_xxh3_128 = xxhash.xxh3_128_digest
_PACKERS: dict[int, Callable[..., bytes]] = {}  # block length -> int64 little-endian packer


def packer(n: int) -> Callable[..., bytes]:
    """``pack(*token_ids)`` of ``n`` token ids as int64 little-endian bytes (struct.error for a
    value that is no int64)."""
    pack = _PACKERS.get(n)
    if pack is None:
        pack = _PACKERS[n] = struct.Struct(f"<{n}q").pack
    return pack


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """A block's token ids as the bytes its key stores and its digest reads."""
    return packer(len(token_ids))(*token_ids)


def unpack_tokens(data: bytes) -> tuple[int, ...]:
    """The token ids of ``pack_tokens`` bytes."""
    return struct.unpack(f"<{len(data) // 8}q", data)


def _xxh3_packed(parent: bytes | None, data: bytes, salt: bytes) -> bytes:
    return _xxh3_128((XXH3_ROOT_DIGEST if parent is None else parent) + data + salt)


def _sha256_packed(parent: bytes | None, data: bytes, salt: bytes) -> bytes:
    return _sha256((ROOT_DIGEST if parent is None else parent) + data + salt).digest()


def xxh3_block_hash(parent: bytes | None, token_ids: Sequence[int], salt: bytes) -> bytes:
    """The default ``hash_fn``: 128-bit XXH3 over (parent digest, int64 token ids, salt).

    The parent digest and the token bytes have fixed lengths, so the concatenation is unambiguous.
    Stable across processes and machines (XXH3 is specified byte for byte, no per-process seed).

    Args:
      parent: digest of the previous block's key, or ``None`` for the first block.
      token_ids: the block's token ids (non-negative ints below 2**63).
      salt: the cache salt.

    Returns:
      A 16-byte digest.
    """
    return _xxh3_packed(parent, pack_tokens(token_ids), salt)


def sha256_block_hash(parent: bytes | None, token_ids: Sequence[int], salt: bytes) -> bytes:
    """SHA-256 over (parent digest, int64 token ids, salt): the cryptographic option (pass it as
    ``hash_fn``; the default before XXH3). Returns a 32-byte digest."""
    return _sha256_packed(parent, pack_tokens(token_ids), salt)


xxh3_block_hash.packed = _xxh3_packed
sha256_block_hash.packed = _sha256_packed


def packed_hash_fn(hash_fn: HashFn) -> PackedHashFn:
    """``hash_fn`` over packed token ids: its own ``packed`` attribute when it has one (the
    functions above), else ``hash_fn`` called with the unpacked tuple."""
    packed = getattr(hash_fn, "packed", None)
    if packed is not None:
        return packed

    def call(parent, data: bytes, salt: bytes):
        return hash_fn(parent, unpack_tokens(data), salt)

    return call


class BlockKey:
    """The full key of one full block: (parent key, packed token ids, salt), plus its digest.

    Keys are immutable and shared: a sequence that hits a cached block adopts the cached key object,
    so parent chains usually compare by identity. Equality is structural (the whole chain).
    ``data`` is the block's token ids as ``pack_tokens`` bytes (``token_ids`` unpacks them); the
    index compares it for equality only, so any comparable value works in its place.
    """

    __slots__ = ("parent", "data", "salt", "digest")  # noqa: RUF023 (the key's own order)

    def __init__(self, parent: BlockKey | None, data: bytes, salt: bytes, digest: Hashable):
        self.parent = parent
        self.data = data
        self.salt = salt
        self.digest = digest

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The block's token ids."""
        return unpack_tokens(self.data)

    def matches(self, parent: BlockKey | None, data: bytes, salt: bytes) -> bool:
        """Whether this key equals the key (parent, data, salt), comparing the whole chain."""
        return self.data == data and self.salt == salt and keys_equal(self.parent, parent)

    def prefix_token_ids(self) -> tuple[int, ...]:
        """All token ids from the first block up to and including this one (for tests and debug)."""
        parts = []
        key: BlockKey | None = self
        while key is not None:
            parts.append(key.token_ids)
            key = key.parent
        return tuple(t for part in reversed(parts) for t in part)

    def __repr__(self) -> str:
        return f"BlockKey(depth={len(self.prefix_token_ids())}, token_ids={self.token_ids})"


def keys_equal(a: BlockKey | None, b: BlockKey | None) -> bool:
    """Structural equality of two key chains, iterative (chains can be thousands of blocks deep)."""
    while a is not b:
        if a is None or b is None:
            return False
        if a.digest != b.digest or a.data != b.data or a.salt != b.salt:
            return False
        a, b = a.parent, b.parent
    return True


class PrefixCacheIndex:
    """Digest -> physical blocks, with the key and content version each block was cached at.

    Holds no refcounts and no LRU: those belong to the block manager. At most one block is indexed
    per distinct key (a second block computed with an equal key stays unindexed). A bucket is the
    block itself, or a list of blocks once two keys share a digest (a weak or colliding
    ``hash_fn``): the common case then costs one dict entry and no list.

    Args:
      num_blocks: size of the physical pool (block ids are ``0 .. num_blocks - 1``).
    """

    def __init__(self, num_blocks: int):
        self.buckets: dict[Hashable, int | list[int]] = {}  # digest -> block, or blocks if collided
        self.key: list[BlockKey | None] = [None] * num_blocks  # key of each indexed block
        self.version: list[int] = [0] * num_blocks  # content version it was indexed at
        self._collided = 0  # indexed blocks beyond the first of each bucket
        self.generation = 0  # bumped by every change: a lookup result is valid while it holds
        # Told of every key indexed (``stored(key, block)``) and dropped (``removed(digest,
        # block)``): `paged.kv.events` (KV events for routers), `paged.kv.blocks.residency`;
        # None: nobody listens.
        self.events = None

    def __len__(self) -> int:
        return len(self.buckets) + self._collided

    def find(self, digest: Hashable, parent: BlockKey | None, data: bytes, salt: bytes,
             versions: Sequence[int]) -> int | None:
        """The block indexed under the full key (parent, data, salt), or ``None``.

        Every candidate with a matching digest is verified against the full key and the block's
        current content version ``versions[block]``; colliding or stale entries are skipped.
        """
        bucket = self.buckets.get(digest)
        if bucket is None:
            return None
        for block in (bucket,) if type(bucket) is int else bucket:
            key = self.key[block]
            if key.matches(parent, data, salt) and self.version[block] == versions[block]:
                return block
        return None

    def intern(self, block: int, parent: BlockKey | None, data: bytes, salt: bytes,
               digest: Hashable, versions: Sequence[int]) -> BlockKey:
        """The indexed key equal to (parent, data, salt), indexing ``block`` under a new key
        at content version ``versions[block]`` if there is none.

        The common case, a digest not indexed yet and an unindexed ``block``, is one dict probe
        and insert.

        Raises:
          RuntimeError: if ``block`` is already indexed under a different key.
        """
        buckets = self.buckets
        if self.key[block] is None:
            bucket = buckets.setdefault(digest, block)
            if bucket is block:  # a new digest: ``block`` is its bucket now
                key = self.key[block] = BlockKey(parent, data, salt, digest)
                self.version[block] = versions[block]
                self.generation += 1
                if self.events is not None:
                    self.events.stored(key, block)
                return key
        else:
            bucket = buckets.get(digest)
        if bucket is not None:
            for b in (bucket,) if type(bucket) is int else bucket:
                key = self.key[b]
                if key.matches(parent, data, salt) and self.version[b] == versions[b]:
                    return key
        key = BlockKey(parent, data, salt, digest)
        self.add(block, key, versions[block])
        return key

    def add(self, block: int, key: BlockKey, version: int) -> None:
        """Indexes ``block`` under ``key`` at content ``version`` (no equal key may be indexed).

        Raises:
          RuntimeError: if ``block`` is already indexed.
        """
        if self.key[block] is not None:
            raise RuntimeError(
                f"block {block} is indexed under {self.key[block]!r}, not under {key!r}")
        self.key[block] = key
        self.version[block] = version
        self.generation += 1
        if self.events is not None:
            self.events.stored(key, block)
        buckets = self.buckets
        bucket = buckets.setdefault(key.digest, block)
        if bucket is not block:  # a digest collision: the bucket becomes (or is) a list
            if type(bucket) is int:
                buckets[key.digest] = [bucket, block]
            else:
                bucket.append(block)
            self._collided += 1

    def remove(self, block: int, digest: Hashable) -> None:
        """Drops ``block`` from the index.

        Args:
          block: an indexed block.
          digest: the digest of its key (the caller has it at hand, so eviction need not load
            the key).

        Raises:
          RuntimeError: if ``block`` is not indexed under ``digest`` (nothing changed).
        """
        buckets = self.buckets
        bucket = buckets.pop(digest, None)
        if bucket is block or type(bucket) is int and bucket == block:
            self.key[block] = None
            self.generation += 1
            if self.events is not None:
                self.events.removed(digest, block)
            return
        if type(bucket) is list and block in bucket:  # collided digests: put the others back
            bucket.remove(block)
            buckets[digest] = bucket[0] if len(bucket) == 1 else bucket
            self._collided -= 1
            self.key[block] = None
            self.generation += 1
            if self.events is not None:
                self.events.removed(digest, block)
            return
        if bucket is not None:
            buckets[digest] = bucket
        raise RuntimeError(f"block {block} is not indexed under digest {digest!r}")

    def blocks(self) -> list[int]:
        """All indexed blocks (O(index size); for checks and debugging)."""
        return [b for bucket in self.buckets.values()
                for b in ((bucket,) if type(bucket) is int else bucket)]

    def check(self, versions: Sequence[int]) -> None:
        """Raises AssertionError if the index is inconsistent or holds a stale entry."""
        count = 0
        for digest, bucket in self.buckets.items():
            if type(bucket) is int:
                bucket = [bucket]
            elif len(bucket) < 2:
                raise AssertionError(f"list bucket of {len(bucket)} blocks for digest {digest!r}")
            for block in bucket:
                key = self.key[block]
                if key is None or key.digest != digest:
                    raise AssertionError(f"block {block} in bucket {digest!r} has key {key!r}")
                if self.version[block] != versions[block]:
                    raise AssertionError(
                        f"stale cache entry: block {block} cached at version "
                        f"{self.version[block]}, "
                        f"now at version {versions[block]}")
                count += 1
        indexed = sum(k is not None for k in self.key)
        if count != len(self) or indexed != len(self):
            raise AssertionError(f"index size {len(self)} != entries {count} != keyed {indexed}")


class PrefixKeyer:
    """Digests full blocks with ``hash_fn``: lookups for new prompts, keys for computed blocks.

    Args:
      index: the prefix-cache index.
      block_size: tokens per block.
      hash_fn: ``hash_fn(parent_digest | None, token_ids, salt) -> digest``; the keyer calls it
        over packed token ids (``packed_hash_fn``).
      versions: the pool's per-block content versions.
      fence: the step fence (a block whose copy has not run yet is not keyed).
      enabled: whether prefix caching is on (off: no lookups, no keys).
      debug: leave every sequence on the checked keying path (``key_at = -1``).
    """

    def __init__(self, index: PrefixCacheIndex, block_size: int, hash_fn: HashFn,
                 versions: Sequence[int], fence, *, enabled: bool, debug: bool):
        self.index = index
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.digest = packed_hash_fn(hash_fn)  # (parent digest, packed ids, salt) -> digest
        self.pack = packer(block_size)  # pack(*ids) of one block
        self.versions = versions
        self.fence = fence
        self.enabled = enabled
        self.debug = debug

    def match(self, tokens: list[int], salt: bytes, probe=None) -> list[tuple[int, BlockKey]]:
        """(block, key) of the indexed blocks serving the longest prefix of full blocks of
        ``tokens``, never the block holding the final token. Read only.

        ``probe`` (a ``paged.kv.blocks.probe.PrefixProbe`` of the same tokens) shares the block digests
        across managers of the same block size, digest function and salt.
        """
        if not self.enabled:
            return []
        B, find, digest, versions = self.block_size, self.index.find, self.digest, self.versions
        pack, key_of = self.pack, self.index.key
        conf = (B, self.hash_fn, salt)
        hits = []
        parent = None
        for i in range((len(tokens) - 1) // B):
            data = pack(*tokens[i * B:(i + 1) * B])
            pd = None if parent is None else parent.digest
            d = digest(pd, data, salt) if probe is None else probe.digest(i, pd, data, conf, digest)
            b = find(d, parent, data, salt, versions)
            if b is None:
                break
            parent = key_of[b]
            hits.append((b, parent))
        return hits

    def key_computed(self, seqs: Iterable, rs=None, computed=None) -> None:
        """Keys the full computed blocks of each of ``seqs`` that have no key yet, indexing each
        unless an equal key is indexed already (then the sequence adopts that key, so chains keep
        comparing by identity). Sets each sequence's ``key_at`` (the computed count below which
        there is nothing to key).

        Stops at a block whose copy has not run yet or that holds a slot of unknown token id.
        The computed counts are read at once (or handed over); each block is one slice of its
        token row (``tobytes``: int64 little-endian, the bytes of
        ``pack_tokens``), one digest and one ``intern``. ``rs``: the token rows of ``seqs`` when
        the caller has them (then ``seqs`` is a list of distinct sequences), ``computed`` their
        computed counts (a list) when it has those too.
        """
        if not self.enabled:
            return
        if rs is None:
            seqs = list(dict.fromkeys(seqs))  # each once
            rs = [seq.row for seq in seqs]
        if not seqs:
            return
        B = self.block_size
        fence = self.fence
        copying = fence.copy_step > fence.last_completed  # some block may have a copy pending
        rows = seqs[0].rows  # one manager's sequences: one store
        key_at = rows.key_at
        if computed is None:
            computed = rows.computed[rs].tolist() if len(rs) > 8 else [
                int(rows.computed[r]) for r in rs]
        keep = not self.debug  # debug: every sequence stays on the checked path (key_at -1)
        for seq, r, c in zip(seqs, rs, computed):
            nokey = seq.nokey
            i = self._key_blocks(seq, r, rows, c // B if not nokey else 0, copying)
            if keep:
                key_at[r] = (i + 1) * B if not nokey else 2**63 - 1

    def key_run(self, seqs: list, rs: list[int], events: list[tuple[int, int]],
                key_at: list[int]) -> None:
        """``key_computed`` for the readbacks of a decode run (`paged.kv.blocks.decode_run`),
        in one call: ``events`` lists ``(k, c)`` in readback order, sequence ``seqs[k]`` (token
        row ``rs[k]``) having ``c`` slots computed now. It is keyed only when ``c >= key_at[k]``
        (a list of the sequences' keying thresholds, which the caller writes back to the rows),
        and its new threshold goes to ``key_at[k]``. The same keys, in the same order, as one
        ``key_computed`` per event."""
        if not self.enabled:
            return
        B = self.block_size
        fence = self.fence
        copying = fence.copy_step > fence.last_completed  # some block may have a copy pending
        rows = seqs[0].rows if seqs else None
        for k, c in events:
            if c < key_at[k]:
                continue
            seq = seqs[k]
            nokey = seq.nokey
            i = self._key_blocks(seq, rs[k], rows, c // B if not nokey else 0, copying)
            key_at[k] = (i + 1) * B if not nokey else 2**63 - 1

    def _key_blocks(self, seq, r: int, rows, upto: int, copying: bool) -> int:
        """Keys ``seq``'s blocks from its first unkeyed one up to block ``upto`` (exclusive;
        token row ``r`` of ``rows``), stopping at a block whose copy has not run yet, that was
        recycled unkeyed or that holds a slot of unknown token id; returns how many of its
        blocks are keyed now."""
        keys = seq.keys
        i = len(keys)
        if upto <= i:
            return i
        B, versions, digest, intern = self.block_size, self.versions, self.digest, \
            self.index.intern
        busy, done = self.fence.busy_until, self.fence.last_completed
        table, salt, front, tok = seq.table, seq.salt, seq.front, rows.tok
        parent = keys[-1] if i else None
        unknown = rows.unknown[r]
        while i < upto:
            b = table[i]
            if copying and busy[b] > done or i < front:
                break  # its copy has not run yet, or it was recycled unkeyed
            ids = tok[r, i * B:(i + 1) * B]
            if unknown and (ids < 0).any():  # a slot of unknown token id: stop here
                break
            data = ids.tobytes()
            parent = intern(b, parent, data, salt,
                            digest(None if parent is None else parent.digest, data, salt),
                            versions)
            keys.append(parent)
            i += 1
        return i
