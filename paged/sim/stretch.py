"""Fast-forward's plan: a stretch of pure decode steps whose schedule is known in advance.

`plan_stretch` looks at a replica's host state (input batch, scheduler, block manager) and, when
the next steps surely are pure decode steps of every running sequence (``paged.sim.replica``'s
module docstring says when), computes their times (the step model's time of each step's shape:
the same float sums as stepping), the blocks they would start, the step from which one would
evict a cached block, and their pseudo-tokens, without running them. ``SimReplica`` applies a
`Stretch` (``advance_to``, ``truncate``; `apply_stretch` writes the steps that ended) and owns
it while it runs.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from functools import reduce

import numpy as np

from paged.request.sequence import UNKNOWN
from paged.sim.batches import pseudo_token_steps
from paged.step.batch import StepBatch
from paged.step.input_batch import HAS_STOP_IDS, LIMIT, SAMPLE_INDEX, SEED


def plan_stretch(ib, sched, bm, config, builder, step_model, *, now: float, max_steps: int,
                 page_size: int, after_idle: bool, token_salt: int, tier: bool,
                 steady: bool = False, pads: dict | None = None) -> Stretch | None:
    """The stretch of pure decode steps from ``now`` (at most ``max_steps``, ending with the
    first step that samples a sequence's last token, or before the pool could run short; with a
    host tier (``tier``), before the first eviction, whose offload is a copy to price), or
    ``None`` when the next steps are not surely such steps.

    ``steady``: the rows are what a stretch applied to its end left (``SimReplica.continue_at``:
    its rows less those its last step finished), so each is known to be a steady decoder with
    ``n == 1``, no stop ids and its next input token known (an applied step writes it, and a
    finish only removes rows); those per-row checks are skipped. The queues and the pool are
    checked as always. ``pads``: a memo of ``builder.buckets`` by row count (the builder's
    buckets are fixed at construction), or None."""
    page, cfg = page_size, config
    n = ib.num_rows
    if sched.waiting or sched.swapped or sched.loading or not n or n != len(sched.running) \
            or n > cfg.max_num_seqs or n > cfg.max_num_batched_tokens:
        return None
    nt, ints = ib.num_tokens[:n], ib.ints[:n]
    # Step j samples position nt + j; it ends a sequence when nt + j + 1 >= its limit. The
    # stretch runs to the first step that ends one (included: ``_apply`` finishes it).
    left = ints[:, LIMIT] - nt  # steps to each row's last token
    last = int(left.min())
    k = min(last, max_steps)
    if k < 2:  # (checked first)
        return None
    nc, ns = ib.num_computed[:n], ib.num_slots[:n]
    first = ib.tokens[np.arange(n), nc]
    if not steady and (
            not ((nt - nc == 1) & (nc >= ib.num_prompt[:n]) & (ns == nc) & ~ib.hold[:n]).all()
            or ints[:, HAS_STOP_IDS].any() or any(q.params.n != 1 for q in ib.seqs[:n])
            or (first == UNKNOWN).any()):
        return None
    # New blocks: step j starts one for each row whose slot ns + j is a block's first. Most
    # stretches fit in the free blocks: counted per row in closed form, without the
    # (rows x steps) table that finds the step where the pool runs short.
    # A row starts at most one block in any ``page`` consecutive steps: the bound, in Python
    # integers, settles the usual case (a pool far from full) before the exact count.
    free = bm.num_free_blocks
    if n * ((k - 1) // page + 1) <= free \
            or int(((ns + (k - 1)) // page - (ns - 1) // page).sum()) <= free:
        evict_from = k  # no step evicts a cached block, none runs short
    else:
        need = np.cumsum(((ns[:, None] + np.arange(k)) % page == 0).sum(axis=0))
        short = np.flatnonzero(need > bm.num_allocatable_blocks)
        if len(short):
            k = int(short[0])
            if k < 2:
                return None
        # Steps before this one take only free blocks: no cached block is evicted.
        over = np.flatnonzero(need[:k] > free)
        evict_from = int(over[0]) if len(over) else k
    if tier:  # an eviction offloads (a copy to price): step it instead
        c = bm.host_tier_stats()
        if c["writing"] or c["held"] or evict_from < 2:
            return None
        k = evict_from
    pad = pads.get(n) if pads is not None else None
    if pad is None:  # (tokens, sequences) buckets of a decode step of n rows
        pad = builder.buckets(n, n, n)[:2]
        if pads is not None:
            pads[n] = pad
    tp, sp = pad
    durs = step_model.decode_times(n, int(nc.sum()) + n, k, tp, sp, int(after_idle))
    # The begin times stepping reaches (each end is begin + duration): a sequential sum.
    clock = np.empty(k + 1)
    clock[0] = now
    clock[1:] = durs
    clock = np.add.accumulate(clock)
    times = clock.tolist()
    starts, ends = times[:-1], times[1:]
    toks = np.empty((n, k + 1), np.int64)
    toks[:, 0] = first
    toks[:, 1:] = pseudo_token_steps(ints[:, SEED], ints[:, SAMPLE_INDEX], nt, k,
                                     token_salt)
    return Stretch(n, k, nt.astype(np.int64), starts, ends, durs, toks, evict_from, k == last,
                   clock[1:], left)


class Stretch:
    """A planned run of pure decode steps (`plan_stretch`; applied by ``SimReplica``)."""

    __slots__ = ("done", "durs", "end_times", "ends", "evict_from", "finishes", "firsts", "k",
                 "left", "n", "nt0", "starts", "toks")

    def __init__(self, n, k, nt0, starts, ends, durs, toks, evict_from, finishes, end_times,
                 left):
        self.n, self.k, self.nt0 = n, k, nt0
        self.finishes = finishes  # its last step samples some sequence's last token
        self.starts, self.ends, self.durs = starts, ends, durs
        self.end_times = end_times  # ``ends`` as f64[k]
        self.left = left  # per row, the step (1-based) that samples its last token
        self.toks = toks
        self.evict_from = evict_from
        self.firsts = None  # (prompt length, first sampled token) per row, when first needed
        self.done = 0

    def prefix_unchanged(self, ib, token_ids, t: float) -> bool:
        """Whether a prefix-cache query of ``token_ids`` answers at ``t`` what it answers now,
        mid-stretch (``ib``: the replica's input batch, not applied yet): the steps begun before
        ``t`` take only free blocks (no cached block is evicted), and no block the stretch keys
        can extend the prompt's hit. A block a decode fills holds one of the row's sampled
        tokens, so its key matches a prompt only if the prompt continues the row's prompt with
        the row's first sampled token; a prompt that differs from every row there is unaffected."""
        if bisect_left(self.starts, t) > self.evict_from:
            return False
        if self.firsts is None:
            lens = ib.num_prompt[:self.n]
            self.firsts = list(zip(lens.tolist(), ib.tokens[np.arange(self.n), lens].tolist()))
        m = len(token_ids)
        return not any(L < m and token_ids[L] == tok for L, tok in self.firsts)


def apply_stretch(st: Stretch, upto: int, ib, sched, bm, reader, *, busy_s: float, name: str,
                  log: list | None) -> tuple[float, tuple | None]:
    """Applies planned steps ``st.done .. upto - 1`` as stepping would have run them.

    The block manager's calls of those steps (each step's decode append, ``begin_step`` /
    ``step_completed`` and ``mark_computed_many`` of the blocks it filled) are made in one
    ``BlockManager.run_decode_steps``, which leaves the state they leave; the input-batch rows
    are written in bulk; ``log`` (a replica's schedule log, or None) gets each step.

    Returns:
      ``busy_s`` plus the steps' durations (added one by one, as stepping adds them), and, when
      the stretch's last step (which samples some sequences' last token) was applied, its
      readback: ``(decodes, made)`` (``StepReader.stops_and_outputs``), else None.
    """
    j0, n, nt0 = st.done, st.n, st.nt0
    m = upto - j0
    if not bm.run_decode_steps(ib.ids[:n], st.toks[:, j0:upto]):
        raise RuntimeError(f"{name}: a fast-forwarded decode run needed more blocks than the "
                           "pool had")
    if log is not None:
        ran = [(q.request_id, 1) for q in ib.seqs[:n]]
        for j in range(j0, upto):
            log.append((st.starts[j], list(ran), []))
    busy_s = reduce(operator.add, st.durs[j0:upto], busy_s)  # one by one, in step order
    sched.num_fast_decode_steps += m
    rows = np.arange(n)
    # Row r's slots nt0[r] + j0 .. nt0[r] + upto - 1, as flat indices (row-major): the sampled
    # tokens, and the step end times (the same m times in every row).
    flat = (rows * ib.tokens.shape[1] + nt0)[:, None] + np.arange(j0, upto)
    ib.tokens.put(flat, st.toks[:, j0 + 1:upto + 1])
    ib.times.put(flat, st.end_times[j0:upto])  # (repeated row after row)
    ib.num_slots[:n] += m
    ib.num_computed[:n] += m
    ib.num_tokens[:n] = nt0 + upto
    ib.last_slot[:n] = rows
    st.done = upto
    if upto < st.k or not st.finishes:
        return busy_s, None
    k = st.k
    pos = nt0 + (k - 1)  # the positions the last step sampled
    batch = StepBatch(device=None, num_tokens=n, num_seqs=n, decode=ib.seqs[:n], decode_pos=pos,
                      samples=[], items=[], item_ends=[], decode_rows=rows, epoch=ib.epoch,
                      stop_any=np.flatnonzero(st.left <= k))  # pos + 1 >= limit
    made = reader.stops_and_outputs(batch, rows, st.toks[:, k], st.ends[k - 1], True)
    return busy_s, (batch.decode, made)
