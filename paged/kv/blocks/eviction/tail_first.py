"""Tail first within a chain (kvcache-ai/Mooncake#492): LRU over the leaves of the cached prefix
forest. A block whose child in its chain is cached is skipped until that child goes, so a
chain is never cut in the middle (a cached block behind an evicted one can never be hit). LRU
already releases a sequence's tail first; this guards the other orders of release (the host
tier's, a hit that revives a chain's head only)."""

from __future__ import annotations

from paged.kv.blocks.eviction.lru import LRUOrder


class TailFirstOrder(LRUOrder):
    name = "tail_first"

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.children: dict = {}  # digest -> cached members whose parent key has that digest
        self.parent_of: dict[int, object] = {}

    def __setitem__(self, b: int, digest) -> None:
        super().__setitem__(b, digest)
        parent = self.index.key[b].parent
        if parent is not None:
            self.parent_of[b] = parent.digest
            self.children[parent.digest] = self.children.get(parent.digest, 0) + 1

    def _left(self, b: int) -> None:
        p = self.parent_of.pop(b, None)
        if p is not None:
            n = self.children[p] - 1
            if n:
                self.children[p] = n
            else:
                del self.children[p]

    def __delitem__(self, b: int) -> None:
        super().__delitem__(b)
        self._left(b)

    def _victim(self, keys, children):
        for b in keys:
            if self[b] not in children:
                return b
        return next(iter(keys))  # unreachable for a forest; stay total anyway

    def evict_one(self):
        victim = self._victim(self.keys(), self.children)
        digest = self.pop(victim)
        self._left(victim)
        return victim, digest

    def __iter__(self):
        """Victim order (each victim's removal may make its parent a leaf): O(n^2), for queries."""
        keys, children = dict.fromkeys(self.keys()), dict(self.children)
        while keys:
            b = self._victim(keys, children)
            yield b
            del keys[b]
            p = self.parent_of.get(b)
            if p is not None:
                children[p] -= 1
                if not children[p]:
                    del children[p]
