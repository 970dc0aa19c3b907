"""What a simulated step reads and samples, without a device: its shape for the step-time model
(``step_shape``, which the engine's calibration measures with too), the parts of a ``StepBatch``
that ``BatchBuilder.commit`` and ``StepReader.read`` use (``light_batch``), and deterministic
pseudo-tokens in place of a model's samples (``pseudo_tokens``)."""

from __future__ import annotations

import numpy as np

from paged.sim.step_model import StepShape
from paged.step.batch import BatchBuilder, StepBatch
from paged.step.input_batch import HAS_STOP_IDS, LIMIT, SAMPLE_INDEX, SEED, InputBatch
from paged.step.scheduler import SchedulerOutput


def pseudo_tokens(seeds, sample_index, positions, salt: int = 0) -> np.ndarray:
    """Deterministic byte tokens, i64[n]: an integer mix of (seed, sample index, position, salt);
    int64 products wrap, which numpy does the same way everywhere."""
    x = (np.asarray(seeds, np.int64) * 40503 + np.asarray(positions, np.int64) * 2654435761
         + np.asarray(sample_index, np.int64) * 97 + salt)
    x ^= x >> 15
    x *= 0x2C1B3C6D
    x ^= x >> 12
    return x & 255


_WORD = (1 << 64) - 1


def _int64(x: int) -> int:
    """``x`` wrapped to a signed 64-bit integer (what numpy's int64 arithmetic leaves)."""
    x &= _WORD
    return x - (1 << 64) if x >> 63 else x


def pseudo_token(seed: int, sample_index: int, position: int, salt: int = 0) -> int:
    """``pseudo_tokens`` of one slot in Python integers (the same wrapped int64 mix: ``>>`` of
    a negative int is arithmetic in both, ``& 255`` reads the same low bits)."""
    x = _int64(seed * 40503 + position * 2654435761 + sample_index * 97 + salt)
    x ^= x >> 15
    x = _int64(x * 0x2C1B3C6D)
    x ^= x >> 12
    return x & 255


def pseudo_token_steps(seeds, sample_index, positions, k: int, salt: int = 0) -> np.ndarray:
    """``pseudo_tokens`` of each row at positions ``positions[r] + j`` for ``j < k``: i64[n, k].
    The row's part of the mix is computed once; int64 sums and products wrap, so regrouping them
    gives the same integers."""
    base = (np.asarray(seeds, np.int64) * 40503 + np.asarray(positions, np.int64) * 2654435761
            + np.asarray(sample_index, np.int64) * 97 + salt)
    x = base[:, None] + np.arange(k, dtype=np.int64) * 2654435761
    x ^= x >> 15
    x *= 0x2C1B3C6D
    x ^= x >> 12
    x &= 255
    return x


def step_shape(ib: InputBatch, builder: BatchBuilder, sched: SchedulerOutput, *,
               after_idle: bool = False, window: int | None = None) -> StepShape:
    """The shape of the step ``sched`` describes, read from the input batch before the step is
    committed (``BatchBuilder.commit`` moves the computed counts on). The engine's steps are
    measured with the same function (``experiments/calibrate.py``).

    ``window``: W when every layer attends through a sliding window (``paged.kv.blocks.window``):
    the query at position ``p`` reads positions ``[p - W + 1, p]``, so a decode reads
    ``min(kv_len, W)`` positions and a chunk of ``n`` tokens after ``c`` computed ones reads the
    union of its queries' windows, ``min(c + n, W + n - 1)``, and scores
    ``sum over its positions p of min(p + 1, W)`` pairs. Counted in positions, as without a window
    (the kernels' page loops start at the first page that can matter, so they read up to one
    partly used page more at each end; not counted, as the tail page is not counted without one).
    """
    rows = sched.decode_rows
    nd = len(rows)
    if not nd:
        kv = 0
    elif window is None:
        kv = int(ib.num_computed[rows].sum()) + nd
        if builder.kv_offsets:  # a KV policy dropped positions: attention reads the slots
            kv -= int(ib.dropped[rows].sum())
    else:
        kv = int(np.minimum(ib.num_computed[rows] + 1, window).sum())
    pairs = kv
    t = dec = samples = nd
    prefill = 0
    for item in sched.scheduled:
        q, n = item.seq, item.num_new_tokens
        c = q.num_computed_tokens
        t += n
        if window is None:
            held = c - q.num_dropped if builder.kv_offsets else c  # slots (a KV policy)
            kv += held + n
            pairs += n * held + n * (n + 1) // 2
        else:
            kv += min(c + n, window + n - 1)
            pairs += window_pairs(c + n, window) - window_pairs(c, window)
        if n == 1 and c >= q.num_prompt_tokens:
            dec += 1
        else:
            prefill += n
        if c + n == q.num_tokens:
            samples += q.params.n if q.sample_index == 0 and q.num_output_tokens == 0 else 1
    s = nd + len(sched.scheduled)
    tp, sp, _ = builder.buckets(t, s, samples)
    return StepShape(num_tokens=t, num_seqs=s, num_decode=dec, num_prefill_tokens=prefill,
                     kv_read=kv, attn_pairs=pairs, num_samples=samples, padded_tokens=tp,
                     padded_seqs=sp, swap_blocks=len(sched.swap_in) + len(sched.swap_out),
                     copy_blocks=len(sched.copies), after_idle=int(after_idle))


def window_pairs(m: int, window: int) -> int:
    """Query x key pairs of positions ``0 .. m - 1`` under a sliding window of ``window``:
    ``sum_{p < m} min(p + 1, window)``."""
    if m <= window:
        return m * (m + 1) // 2
    return window * (window + 1) // 2 + (m - window) * window


def light_batch(ib: InputBatch, sched: SchedulerOutput) -> StepBatch:
    """The parts of ``BatchBuilder.build``'s ``StepBatch`` that ``commit`` and ``StepReader.read``
    use, without the padded device arrays (serial steps: no token is fed from a step in flight).
    """
    rows = sched.decode_rows
    nd = len(rows)
    decode = list(ib.seqs) if nd == ib.num_rows else [ib.seqs[r] for r in rows.tolist()]
    samples, ends = [], []
    slot = nd
    t = nd
    for item in sched.scheduled:
        q, n = item.seq, item.num_new_tokens
        c = q.num_computed_tokens
        ends.append(c + n)
        t += n
        if c + n == q.num_tokens:
            count = q.params.n if q.sample_index == 0 and q.num_output_tokens == 0 else 1
            samples.append((q, slot, count, c + n))
            slot += count
    if not nd or rows[-1] == nd - 1:  # rows 0 .. nd - 1 (ascending): views, not gathers
        decode_pos, ints = ib.num_tokens[:nd].astype(np.int64), ib.ints[:nd]
    else:
        decode_pos, ints = ib.num_tokens[rows].astype(np.int64), ib.ints[rows]
    stop_any = np.flatnonzero((decode_pos + 1 >= ints[:, LIMIT]) | (ints[:, HAS_STOP_IDS] != 0))
    return StepBatch(device=None, num_tokens=t, num_seqs=nd + len(sched.scheduled), decode=decode,
                     decode_pos=decode_pos, samples=samples, items=list(sched.scheduled),
                     item_ends=ends, stop_any=stop_any, decode_rows=rows, epoch=ib.epoch)




def step_tokens(ib: InputBatch, batch: StepBatch, salt: int) -> np.ndarray:
    """A simulated step's "sampled" tokens, one per sample slot (decodes first): the
    pseudo-tokens of each row's (seed, sample index, position)."""
    nd = len(batch.decode)
    n = nd + sum(c for _, _, c, _ in batch.samples)
    out = np.zeros(n, np.int64)
    if nd:
        rows = batch.decode_rows
        ints = ib.ints[:nd] if rows[-1] == nd - 1 else ib.ints[rows]  # (ascending rows)
        out[:nd] = pseudo_tokens(ints[:, SEED], ints[:, SAMPLE_INDEX], batch.decode_pos, salt)
    for q, slot, count, p in batch.samples:
        if count == 1:  # a prompt's first token (Python integers: the same mix)
            out[slot] = pseudo_token(q.seed, q.sample_index, p, salt)
        else:
            out[slot:slot + count] = pseudo_tokens(
                np.full(count, q.seed), np.arange(count) + q.sample_index, np.full(count, p), salt)
    return out


__all__ = ["light_batch", "pseudo_token", "pseudo_token_steps", "pseudo_tokens", "step_shape",
           "step_tokens", "window_pairs"]
