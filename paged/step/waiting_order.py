"""Cache-aware orders of the waiting queue: ``policy="lpm"`` and ``policy="dfs-weight"``.

SGLang's two cache-aware schedule policies (``python/sglang/srt/managers/schedule_policy.py``),
applied to the waiting queue before admission; the step itself runs as ``"decode-first"``.

* **lpm** (longest prefix match first): waiting requests sorted by the tokens of their prompt
  the prefix cache holds now (device plus host tier, as admission counts hits), longest first;
  ties in arrival order.
* **dfs-weight**: each waiting request hangs at the node of its longest cached prefix (its
  device hit blocks, one node per block, root when nothing hits); a node's weight is the number
  of waiting requests at it or below it; a depth-first walk from the root visits children by
  weight, heaviest first (ties: first seen in arrival order) and emits a node's own requests after
  its children's. Requests sharing cached prefixes are admitted together, heaviest branch first.

**Starvation guard.** A waiting request that has waited ``max_wait_s`` (seconds since its
arrival) or longer, and a preempted request (it ran before), go first, oldest first; only the
others are reordered. So a request waits at most ``max_wait_s`` plus what the requests that
starved before it take, whatever keeps arriving with longer hits.

**Cost.** Only the first ``SCAN_LIMIT`` waiting requests by arrival are reordered (SGLang turns
its order off above 128 waiting; here the rest keep arrival order behind them). Each request's
block digests are computed once while it waits (``PrefixProbe``); a step then costs a dict lookup per
hit block. The order is host state only: it changes which requests are admitted when, never
their tokens.
"""

from __future__ import annotations

import collections

from paged.kv.blocks.prefix_index import xxh3_block_hash
from paged.kv.blocks.probe import PrefixProbe

ORDERS = ("lpm", "dfs-weight")
SCAN_LIMIT = 128


class WaitingOrder:
    """Reorders a scheduler's waiting queue in place (module docstring).

    Args:
      policy: "lpm" or "dfs-weight".
      block_manager: anything with ``tiered_prefix_tokens(tokens, cache_salt=, probe=)``
        (``BlockManager``, ``GroupedBlockManager``).
      block_size: tokens per block.
      max_wait_s: the starvation bound (seconds).
    """

    def __init__(self, policy: str, block_manager, block_size: int, max_wait_s: float):
        if policy not in ORDERS:
            raise ValueError(f"policy={policy!r} is not a cache-aware order {ORDERS}")
        self.policy = policy
        self.bm = block_manager
        self.block_size = block_size
        self.max_wait_s = max_wait_s
        self._probes: dict[int, PrefixProbe] = {}
        self._nodes: dict[int, list] = {}  # seq id -> node ids of its leading blocks
        self.num_starved = 0  # admissions forced by the guard (requests that hit the bound)

    def apply(self, waiting: collections.deque, now: float) -> None:
        """Reorders ``waiting`` (a deque of ``Sequence``) for this step's admission."""
        if len(waiting) < 2:
            return
        seqs = list(waiting)
        live = {s.seq_id for s in seqs}
        for memo in (self._probes, self._nodes):
            for sid in [k for k in memo if k not in live]:
                del memo[sid]
        front, rest = [], []
        for s in seqs:
            (front if s.num_preemptions or now - s.arrival_time >= self.max_wait_s
             else rest).append(s)
        rest.sort(key=lambda s: (s.arrival_time, s.seq_id))
        tail = rest[SCAN_LIMIT:]
        rest = rest[:SCAN_LIMIT]
        hits = [self._hit(s) for s in rest]
        if self.policy == "lpm":
            ranked = [s for _, _, s in sorted(zip([-(d + h) for d, h in hits],
                                                  range(len(rest)), rest))]
        else:
            ranked = dfs_weight_order(
                [(s, self._chain(s, d // self.block_size)) for s, (d, _) in zip(rest, hits)])
        pre = [s for s in front if s.num_preemptions]
        starved = sorted((s for s in front if not s.num_preemptions),
                         key=lambda s: (s.arrival_time, s.seq_id))
        waiting.clear()
        waiting.extend(pre + starved + ranked + tail)

    def note_admitted(self, seq, now: float) -> None:
        """Counts a guard admission (called by the scheduler for each admitted sequence)."""
        if not seq.num_preemptions and now - seq.arrival_time >= self.max_wait_s:
            self.num_starved += 1

    def _hit(self, seq) -> tuple[int, int]:
        probe = self._probes.get(seq.seq_id)
        if probe is None:
            probe = self._probes[seq.seq_id] = PrefixProbe()
        return self.bm.tiered_prefix_tokens(seq.token_ids, cache_salt=seq.cache_salt,
                                            probe=probe)

    def _chain(self, seq, k: int) -> list:
        """Node ids of ``seq``'s first ``k`` blocks: a digest chain over its tokens and salt
        (equal prefixes, equal nodes)."""
        nodes = self._nodes.setdefault(seq.seq_id, [])
        if len(nodes) < k:
            B, toks = self.block_size, seq.token_ids
            salt = seq.cache_salt if isinstance(seq.cache_salt, bytes) else \
                (seq.cache_salt or "").encode()
            while len(nodes) < k:
                i = len(nodes)
                nodes.append(xxh3_block_hash(nodes[-1] if nodes else None,
                                             toks[i * B:(i + 1) * B], salt))
        return nodes[:k]


_ROOT = object()


def dfs_weight_order(chains: list[tuple[object, list]]) -> list:
    """SGLang's DFS-weight order of ``(item, node chain)`` pairs (chains share their leading
    nodes where the items share a cached prefix; ``[]``: the root). Iterative (chains may be
    thousands of blocks deep)."""
    weight: dict = collections.defaultdict(int)
    children: dict = collections.defaultdict(dict)  # node -> children in first-seen order
    at: dict = collections.defaultdict(list)
    for item, chain in chains:
        parent = _ROOT
        for n in chain:
            weight[n] += 1
            children[parent].setdefault(n, None)
            parent = n
        at[parent].append(item)
    out: list = []
    stack = [(_ROOT, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(at[node])
            continue
        stack.append((node, True))
        kids = sorted(children[node], key=lambda c: -weight[c])  # stable: first seen on ties
        stack.extend((c, False) for c in reversed(kids))
    return out


__all__ = ["ORDERS", "SCAN_LIMIT", "WaitingOrder", "dfs_weight_order"]
