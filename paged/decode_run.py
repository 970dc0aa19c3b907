"""A steady decode run: the token state of a repeating decode batch, kept in arrays.

When the same decoding sequences step together again and again (every one takes one token, nothing
else runs), the engine records each step's sampled tokens as one row of an array instead of
appending to every sequence's lists. A sequence's ``token_ids``, ``token_times`` and
``num_computed_tokens`` then lag the run; ``sync`` brings one up to date, and ``end`` all of them.
Readers outside the steady path sync first: the scheduler before it scans running sequences, the
engine before anything else touches them, and a ``RequestOutput`` before it reads its sequence.
``num_slots`` is kept exact by the scheduler throughout.

On a CPU "device" each step evicts the host's caches, so touching a few Python objects per sequence
per step costs far more than the work itself: this keeps a steady step's host work to a handful of
array operations and one small output object per sequence.
"""

from __future__ import annotations

import numpy as np

from paged.sequence import Sequence


class DecodeRun:
    """Steps of one decode batch (``seqs``, in batch order) since the run started.

    Column ``i`` belongs to ``seqs[i]``; row ``j`` of the log holds the tokens sampled at the run's
    step ``j``, at host time ``_times[j]``.
    """

    __slots__ = ("seqs", "states", "num_steps", "_log", "_times", "_synced", "_len0",
                 "_block_size", "_fills")

    def __init__(self, seqs: list[Sequence], ids: list, block_size: int):
        """``seqs``: the batch, each synced (its lists current), decoding, and with the output
        state its outputs share (``out_state``); ``ids``: their sequence ids; ``block_size``: of
        the block manager, to tell which steps fill a block."""
        n = len(seqs)
        self.seqs = seqs
        self.states = [s.out_state for s in seqs]
        self.num_steps = 0
        self._log = np.empty((16, n), np.int32)
        self._times: list[float] = []
        self._synced = np.zeros(n, np.int64)  # steps already written to each sequence
        self._len0 = np.fromiter([len(s.token_ids) for s in seqs], np.int64, n)
        # Step k (counted from 1) fills a block of the sequences whose computed count c0 at the
        # start has c0 + k divisible by block_size: grouped by k mod block_size.
        self._block_size = block_size
        self._fills: dict[int, tuple[list, list[int]]] = {}
        for i, s in enumerate(seqs):
            s.run, s.run_col = self, i
            c0 = s.num_computed_tokens
            ids_, counts = self._fills.setdefault(-c0 % block_size, ([], []))
            ids_.append(ids[i])
            counts.append(c0)

    def record(self, tokens: np.ndarray, now: float) -> None:
        """One step: ``tokens[i]`` was sampled for ``seqs[i]`` (and its input token computed)."""
        k = self.num_steps
        if k == self._log.shape[0]:
            self._log = np.concatenate([self._log, np.empty_like(self._log)])
        self._log[k] = tokens
        self._times.append(now)
        self.num_steps = k + 1

    def lengths(self) -> list[int]:
        """Each sequence's token count now (its lists may lag)."""
        return (self._len0 + self.num_steps).tolist()

    def filled(self) -> tuple[list, list[int]]:
        """Ids and computed counts of the sequences whose last step filled a block."""
        k = self.num_steps
        group = self._fills.get(k % self._block_size)
        if group is None:
            return [], []
        return group[0], [c + k for c in group[1]]

    def sync(self, seq: Sequence) -> None:
        """Writes the run's steps that ``seq``'s lists lack into them."""
        i, k = seq.run_col, self.num_steps
        j = int(self._synced[i])
        if j < k:
            seq.token_ids += self._log[j:k, i].tolist()
            seq.token_times += self._times[j:k]
            seq.num_computed_tokens += k - j
            self._synced[i] = k

    def end(self) -> None:
        """Syncs every sequence and detaches it from the run."""
        for seq in self.seqs:
            self.sync(seq)
            seq.run = None
        self.seqs = []


def sync(seq: Sequence) -> Sequence:
    """``seq`` with its lists current (a no-op outside a run)."""
    if seq.run is not None:
        seq.run.sync(seq)
    return seq
