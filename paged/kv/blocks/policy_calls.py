"""The calls of `BlockManager`'s interface that feed the prefix-cache eviction policy
(`paged.kv.blocks.eviction`) what it cannot see from the pool alone, and the access recorder
an offline optimum (`paged.kv.blocks.belady`) replays. Each call is a no-op for a policy that
does not use it, so callers need not know which policy runs.

`PolicyCalls` is mixed into `paged.kv.block_manager.BlockManager` and reads the parts that class
composes (annotated below).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

from paged.kv.blocks.admission import Admission, as_salt
from paged.kv.blocks.pool import BlockPool
from paged.kv.blocks.prefix_index import PrefixKeyer
from paged.kv.blocks.tables import SeqTables
from paged.kv.paging import NULL_PAGE
from paged.util import validate


class PolicyCalls:
    """Retention, the clock, the waiting queue's protection and the access recorder."""

    _pool: BlockPool
    _keyer: PrefixKeyer
    _tables: SeqTables
    _admission: Admission
    cache_salt: bytes

    @property
    def eviction_policy(self) -> str:
        """The name of the device pool's eviction order (``"lru"``, ``"lfu"``, ...)."""
        return self._pool.lru.name

    def set_retention(self, seq_id, priority: int, until: float | None) -> None:
        """``seq_id``'s blocks keep ``priority`` (0..100, higher stays longer) once released,
        until time ``until`` (None: as long as they stay cached); the last request to release a
        block sets it. Only the ``priority`` policy reads it.

        Raises:
          ValueError: unknown or swapped-out ``seq_id``, a priority outside 0..100.
        """
        validate.integer("priority", priority, minimum=0, maximum=100)
        validate.real("until", until, allow_none=True)
        seq = self._tables.resident(seq_id)
        retain = getattr(self._pool.lru, "retain", None)
        if retain is not None:
            retain([b for b in seq.table if b != NULL_PAGE], priority, until)

    def set_time(self, now: float) -> None:
        """The scheduler's clock (seconds); retention times are on it."""
        advance = getattr(self._pool.lru, "advance", None)
        if advance is not None:
            advance(now)

    @property
    def eviction_feed(self) -> Callable[[float, Iterable], None] | None:
        """``feed(now, waiting)`` for the scheduler to call before each plan (the clock, and
        the head of its waiting queue: Sequences with ``token_ids`` and ``cache_salt``), or
        ``None`` when the policy reads neither."""
        order = self._pool.lru
        if not (hasattr(order, "advance") or hasattr(order, "protect")):
            return None

        def feed(now: float, waiting: Iterable) -> None:
            self.set_time(now)
            k = self.waiting_lookahead
            if k:
                self.protect_waiting((s.token_ids, s.cache_salt)
                                     for s in itertools.islice(waiting, k))

        return feed

    @property
    def waiting_lookahead(self) -> int:
        """How many requests at the head of the waiting queue the policy protects (0: none)."""
        return getattr(self._pool.lru, "lookahead", 0)

    def protect_waiting(self, prompts: Iterable[tuple[Sequence[int], bytes | None]]) -> None:
        """The cached blocks that these ``(prompt token ids, salt)`` would hit now are evicted
        only when nothing else is left (until the next call). Read only otherwise."""
        protect = getattr(self._pool.lru, "protect", None)
        if protect is None:
            return
        blocks = []
        for tokens, salt in prompts:
            salt = self.cache_salt if salt is None else as_salt(salt)
            blocks += [b for b, _ in self._keyer.match(list(tokens), salt)]
        protect(blocks)

    def record_accesses(self, callback: Callable[[list, int], None] | None) -> None:
        """From now on each admission calls ``callback(digests, hits)``: the key digests of the
        prompt's full blocks (the block of the final token left out, as lookups do) and how many
        leading ones the device cache served; ``None`` stops recording."""
        if callback is None:
            self._admission.on_access = None
            return
        keyer = self._keyer

        def record(tokens: list[int], salt: bytes, hits: int) -> None:
            B, pack, digest = keyer.block_size, keyer.pack, keyer.digest
            out, parent = [], None
            for i in range((len(tokens) - 1) // B):
                parent = digest(parent, pack(*tokens[i * B:(i + 1) * B]), salt)
                out.append(parent)
            callback(out, hits)

        self._admission.on_access = record
