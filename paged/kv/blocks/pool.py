"""The block pool: refcount, state and content version of every physical block.

Page ``NULL_PAGE`` is never handed out. Every other block is exactly one of *free* (no content,
in the free queue), *cached* (refcount 0, content indexed in the prefix cache, waiting in the
eviction order),
*used* (refcount > 0) or *quarantined* (refcount 0 but held until a step completes; the step fence
decides when). A block's content version changes whenever it is handed out fresh, so an index entry
made at an older version is recognisably stale. Which cached block goes first is the eviction
order's choice (``paged.kv.blocks.eviction``: LRU by default); when blocks enter and leave the
cached set is the pool's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from paged.kv.blocks.eviction.lru import LRUOrder
from paged.kv.blocks.prefix_index import PrefixCacheIndex
from paged.kv.paging import NULL_PAGE

FREE, CACHED, USED, QUARANTINED, NULL = 0, 1, 2, 3, 4
STATE_NAMES = ("free", "cached", "used", "quarantined", "null")


class BlockPool:
    """Per-block refcount, state and version; the free queue; the cached refcount-0 blocks in
    their eviction order (``lru``, named for the default policy).

    Fresh blocks come from the free queue first, then from the eviction order (its victims first,
    evicting their index entries). Blocks whose content died (entered the free queue, or were
    evicted to be reused) collect in ``died`` until ``flush`` hands them to ``on_free``.

    Args:
      num_blocks: physical pages, counting ``NULL_PAGE``.
      index: the prefix-cache index (eviction drops entries from it).
      on_free: called by ``flush`` with the blocks whose content died, or ``None``.
      order: the eviction order (`paged.kv.blocks.eviction`); None: LRU.
    """

    def __init__(self, num_blocks: int, index: PrefixCacheIndex,
                 on_free: Callable[[list[int]], None] | None, order=None):
        self.num_blocks = num_blocks
        self.index = index
        self.on_free = on_free
        self.rc = [0] * num_blocks
        self.state = [FREE] * num_blocks
        self.state[NULL_PAGE] = NULL
        self.version = [0] * num_blocks
        self.free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_PAGE)
        # Cached blocks in eviction order, with their key digests (eviction needs no key load).
        self.lru = LRUOrder() if order is None else order
        self.on_take, self.on_hit = self.lru.on_take, self.lru.on_hit  # None: no statistics
        self.num_used = 0
        self.num_held = 0  # blocks in the quarantined state
        self.peak_used = 0
        self.evictions = 0
        self.revived = 0  # refcount-0 blocks brought back by a prefix hit
        self.died: list[int] = []
        # Called with (block, key) of each block the LRU evicts, before its index entry goes (a
        # host tier copies it out, `paged.kv.blocks.host_tier`); None: evicted content is lost.
        self.spill: Callable[[int, object], None] | None = None

    @property
    def num_allocatable(self) -> int:
        return len(self.free) + len(self.lru)

    def take(self, n: int) -> list[int]:
        """``n`` blocks with new content (the caller checked capacity): free ones first, then LRU."""
        free = self.free
        if len(free) >= n:
            out = [free.popleft() for _ in range(n)]
        else:
            out = list(free)
            free.clear()
            out += self._evict_lru(n - len(out), to_free=False)
        if self.on_take is not None:
            self.on_take(out)
        version, rc, state = self.version, self.rc, self.state
        for b in out:
            version[b] += 1
            rc[b] = 1
            state[b] = USED
        self.num_used += n
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def _evict_lru(self, n: int, *, to_free: bool) -> list[int]:
        """Drops the order's ``n`` first victims from the cached set and the index."""
        evict_one, remove, spill = self.lru.evict_one, self.index.remove, self.spill
        evicted = []
        for _ in range(n):
            b, digest = evict_one()
            if spill is not None:
                spill(b, self.index.key[b])
            remove(b, digest)
            evicted.append(b)
        self.evictions += n
        if to_free:
            state = self.state
            for b in evicted:
                state[b] = FREE
            self.free.extend(evicted)
            self.died += evicted
        elif self.on_free is not None:  # else nobody reads it: spare the flush
            self.died += evicted
        return evicted

    def evict(self, n: int) -> None:
        """Moves the order's ``n`` first victims (``n <= len(lru)``) to the free queue."""
        self._evict_lru(n, to_free=True)

    def acquire(self, b: int) -> None:
        """One more reference to an indexed block (a prefix hit), reviving it at refcount 0."""
        rc = self.rc[b]
        if rc == 0:
            if self.state[b] == CACHED:
                del self.lru[b]
            else:  # quarantined: its content is intact and a hit only reads it
                self.num_held -= 1
            self.state[b] = USED
            self.num_used += 1
            self.revived += 1
        self.rc[b] = rc + 1
        if self.on_hit is not None:
            self.on_hit(b)

    def deref(self, blocks) -> list[int]:
        """Drops one reference to each of ``blocks``; returns those now at refcount 0, in order."""
        rc = self.rc
        dead = []
        for b in blocks:
            r = rc[b] - 1
            rc[b] = r
            if not r:
                dead.append(b)
        self.num_used -= len(dead)
        return dead

    def quarantine(self, b: int) -> None:
        self.state[b] = QUARANTINED
        self.num_held += 1

    def make_reusable(self, blocks) -> None:
        """Refcount-0 blocks leave use for good, in order: to the eviction order if keyed, else to
        the free queue."""
        key_of, state, lru, free, died = self.index.key, self.state, self.lru, self.free, \
            self.died
        for b in blocks:
            key = key_of[b]
            if key is not None:
                state[b] = CACHED
                lru[b] = key.digest
            else:
                state[b] = FREE
                free.append(b)
                died.append(b)

    def flush(self) -> None:
        """Reports the blocks whose content died since the last flush to ``on_free``."""
        if self.died:
            died, self.died = self.died, []
            if self.on_free is not None:
                self.on_free(died)
