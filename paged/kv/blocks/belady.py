"""Belady's MIN: the offline optimum of a cache over a recorded access sequence.

Given every block access in order (`BlockManager.record_accesses` records, per admission, the key
digests of the prompt's full blocks) and a capacity in blocks, MIN keeps, at each miss, the
blocks used again soonest and drops the one whose next use is farthest (never used again:
farthest of all). It maximizes the number of block accesses that hit; no online policy with the
same capacity hits more. Two counts come out:

* ``block_hits``: accesses that found their block cached (the bound itself);
* ``prefix_hits``: per request, hits before its first miss: what a prefix cache could serve from
  MIN's contents (a block behind a missing one is recomputed anyway).

As an anchor for a real pool it is optimistic: the pool also holds the running sequences' blocks
(decode growth included) and cannot evict them, while MIN gives all ``capacity`` blocks to the
cache. ``bypass=True`` (default) lets MIN not admit a block whose next use is farther than every
cached block's (the optimum without demand admission); ``False`` is the textbook demand-paging
MIN (every miss is admitted).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

NEVER = float("inf")


def belady(requests: Sequence[Sequence[Hashable]], capacity: int, *, bypass: bool = True
           ) -> dict:
    """MIN over ``requests`` (each a list of block keys, in access order) with ``capacity``
    blocks. Returns ``accesses``, ``block_hits``, ``prefix_hits`` and their rates.

    Raises:
      ValueError: ``capacity`` not an int >= 1.
    """
    if type(capacity) is not int or capacity < 1:
        raise ValueError(f"capacity={capacity!r} must be an int >= 1")
    flat = [k for r in requests for k in r]
    nxt = [NEVER] * len(flat)
    last: dict = {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = last.get(flat[i], NEVER)
        last[flat[i]] = i
    cache: dict = {}  # key -> its next use
    heap: list = []  # (-next use, tiebreak, key), lazy
    block_hits = prefix_hits = 0
    i = 0
    for r in requests:
        prefix = True
        for key in r:
            n = nxt[i]
            i += 1
            if key in cache:
                block_hits += 1
                prefix_hits += prefix
            else:
                prefix = False
                if len(cache) >= capacity:
                    while True:  # the cached key used farthest ahead
                        neg, _, far = heap[0]
                        if cache.get(far) == -neg:
                            break
                        heapq.heappop(heap)
                    if bypass and -neg <= n:
                        continue  # the new block is needed no sooner: do not admit it
                    heapq.heappop(heap)
                    del cache[far]
                elif bypass and n == NEVER:
                    continue
            cache[key] = n
            heapq.heappush(heap, (-n, i, key))
    total = len(flat)
    return {"accesses": total, "block_hits": block_hits, "prefix_hits": prefix_hits,
            "block_hit_rate": block_hits / total if total else 0.0,
            "prefix_hit_rate": prefix_hits / total if total else 0.0, "capacity": capacity}
