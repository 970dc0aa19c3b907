"""A prompt's block digests, computed once and shared by every prefix-cache query about it (a
router probing several replicas, a waiting-queue order asking again each step)."""

from __future__ import annotations

from collections.abc import Sequence


class PrefixProbe:
    """One prompt's block digests, computed once and shared by every replica probed.

    The digests are kept for one (block size, digest function, salt); probing a manager that
    differs in any of them starts over.
    """

    __slots__ = ("conf", "digests", "tokens")

    def __init__(self, token_ids: Sequence[int] = ()):
        self.tokens = token_ids
        self.conf = None
        self.digests: list = []

    def digest(self, i: int, parent_digest, data: bytes, conf: tuple, digest_fn):
        """Digest of block ``i`` (``data``: its packed token ids) under ``conf = (block_size,
        hash_fn, salt)``, computed as ``digest_fn(parent_digest, data, salt)`` unless known."""
        if conf != self.conf:
            self.conf, self.digests = conf, []
        ds = self.digests
        if i < len(ds) and ds[i][0] == parent_digest:
            return ds[i][1]
        d = digest_fn(parent_digest, data, conf[2])
        if i == len(ds):
            ds.append((parent_digest, d))
        return d
