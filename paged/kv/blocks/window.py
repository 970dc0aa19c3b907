"""Block recycling for a model whose every layer attends through a sliding window of W tokens.

The token at position ``p`` attends to positions ``[p - W + 1, p]``. Once a sequence's KV is on
device for its first ``c`` slots (``num_computed``), every query it will still compute sits at a
position ``>= c``, so a block whose last slot lies before ``c - W + 1`` is behind every future
query's window: block ``j`` (slots ``[j B, (j + 1) B)``) is recycled when
``(j + 1) B <= c - W + 1``. Recycled blocks leave the table from the front (their entries become
``NULL_PAGE``; ``Seq.front`` counts them) and are released through the step fence like any other
block, so a step in flight that may still read them keeps them quarantined.

A sequence then holds the blocks of positions ``[c - W + 1, len(tokens))``. Stepping serially
(``len(tokens) == c + 1`` when a decode step is built) that is at most ``ceil(W / B) + 1`` blocks
however long the sequence grows; overlapped (``async_scheduling``), the next step's slot is
appended before the previous step is read back and recycles, so one more block can be held for
a step (it would be quarantined while that step runs anyway). A prompt's blocks are all taken at
admission and recycled as its prefill chunks advance.

Prefix caching: a recycled block that was keyed keeps its key and goes to the cached LRU like
any freed keyed block (its content is exactly what a recompute of that prefix would write:
windowed attention of earlier tokens does not depend on later ones). A hit is the longest chain
of cached blocks from the prompt's start, so every block it revives is content-correct; blocks
of the hit that are behind the new sequence's window are recycled again at its first
``mark_computed``. A block recycled before it was keyed (its token ids arrived late) ends its
sequence's key chain: later blocks of that sequence are not cached.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from paged.kv.blocks.fence import StepFence
from paged.kv.blocks.tables import Seq, SeqTables
from paged.kv.paging import NULL_PAGE


class WindowRecycler:
    """Frees the blocks of each sequence that fell wholly behind the sliding window.

    Args:
      tables: the sequence tables.
      fence: the step fence (recycled blocks are released through it: quarantine applies).
      window: W, the sliding window of every layer.
    """

    def __init__(self, tables: SeqTables, fence: StepFence, window: int):
        self.tables, self.fence = tables, fence
        self.window = window
        self.recycled_blocks = 0  # blocks freed because they left the window, since construction
        self.changed: set[Hashable] = set()  # sequences whose tables lost blocks, not yet taken

    def behind(self, num_computed: int) -> int:
        """Leading blocks wholly behind the window of every query at position >= num_computed."""
        return max(0, (num_computed - self.window + 1) // self.tables.block_size)

    def recycle(self, seq_ids: Iterable[Hashable]) -> None:
        """Recycles what each resident sequence of ``seq_ids`` no longer needs."""
        tables = self.tables
        seqs = tables.seqs
        for sid in seq_ids:
            seq = seqs.get(sid)
            if seq is not None and seq.host_table is None:
                self._recycle(sid, seq)

    def _recycle(self, sid: Hashable, seq: Seq) -> None:
        n = min(self.behind(seq.num_computed), len(seq.table) - 1)  # never the tail block
        front = seq.front
        if n <= front:
            return
        self.tables.note_peak(seq)
        dropped = seq.table[front:n]
        seq.table[front:n] = [NULL_PAGE] * (n - front)
        seq.front = n
        self.fence.release(reversed(dropped))  # quarantined while a step may read them
        self.recycled_blocks += len(dropped)
        self.changed.add(sid)

    def take_changed(self) -> set[Hashable]:
        """The sequences whose tables lost blocks since the last call (their batch rows are
        stale)."""
        changed, self.changed = self.changed, set()
        return changed
