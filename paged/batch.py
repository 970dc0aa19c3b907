"""Builds one step's device batch on the host (numpy), padded to power-of-two buckets.

Bucketing keeps the number of distinct shapes (and so XLA compilations) small: tokens, sequences
and sample slots are each rounded up to a power of two. Padding tokens write into the null page;
padding sequences have ``kv_len = 0`` and an empty query range.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import flax
import jax
import numpy as np

from paged.kv_cache import NULL_PAGE, next_pow2
from paged.models.attention import AttentionMetadata
from paged.sequence import Sequence

MIN_TOKENS = 8  # smallest token bucket: tiny batches share one compilation


@flax.struct.dataclass
class DeviceBatch:
    """Everything the jitted step reads; shapes are bucketed."""

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    md: AttentionMetadata  # slot_mapping i32[T], page_indices i32[S, pages_per_seq], ...
    sample_rows: jax.Array  # i32[N]: token row whose logits each sample slot reads
    temperature: jax.Array  # f32[N]
    top_k: jax.Array  # i32[N]
    top_p: jax.Array  # f32[N]
    seed: jax.Array  # i32[N]
    sample_index: jax.Array  # i32[N]
    sample_pos: jax.Array  # i32[N]: position of the token being sampled


@dataclasses.dataclass
class StepBatch:
    device: DeviceBatch
    samples: list[tuple[Sequence, int, int]]  # (sequence, first sample slot, number of slots)
    num_tokens: int
    num_seqs: int


class BatchBuilder:
    """Turns the scheduler's choice into a ``DeviceBatch``."""

    def __init__(self, block_manager, page_size: int, pages_per_seq: int, *,
                 min_tokens: int = MIN_TOKENS, min_seqs: int = 1):
        self.bm = block_manager
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.min_tokens = min_tokens
        self.min_seqs = min_seqs

    def buckets(self, num_tokens: int, num_seqs: int, num_samples: int) -> tuple[int, int, int]:
        """Padded (tokens, sequences, sample slots) of a step."""
        t_pad = next_pow2(max(num_tokens, self.min_tokens))
        s_pad = next_pow2(max(num_seqs, self.min_seqs))
        return t_pad, s_pad, max(s_pad, next_pow2(num_samples))

    def empty(self, t_pad: int, s_pad: int, n_pad: int) -> DeviceBatch:
        """An all-padding batch of the given shape (compiles the step without touching real KV)."""
        z = functools.partial(np.zeros, dtype=np.int32)
        md = AttentionMetadata(slot_mapping=z(t_pad), page_indices=z((s_pad, self.pages_per_seq)),
                               kv_lens=z(s_pad), cu_q_lens=z(s_pad + 1), num_seqs=z(1))
        return DeviceBatch(tokens=z(t_pad), positions=z(t_pad), md=md, sample_rows=z(n_pad),
                           temperature=np.zeros(n_pad, np.float32), top_k=z(n_pad),
                           top_p=np.ones(n_pad, np.float32), seed=z(n_pad), sample_index=z(n_pad),
                           sample_pos=z(n_pad))

    def build(self, scheduled) -> StepBatch:
        s = len(scheduled)
        page_size = self.page_size
        block_table = self.bm.block_table
        # One pass over the sequences in Python; everything else is vectorized numpy.
        seqs, q_lens, starts, token_chunks, tables = [], [], [], [], []
        samples, rows = [], []  # rows: (sequence index, sample index offset) per sample slot
        for i, item in enumerate(scheduled):
            q, n = item.seq, item.num_new_tokens
            c = q.num_computed_tokens
            seqs.append(q)
            q_lens.append(n)
            starts.append(c)
            token_chunks.append(q.token_ids[c:c + n])
            tables.append(block_table(q.seq_id))
            if c + n == q.num_tokens:  # reaches its end: sample (n slots for an unforked prompt)
                count = q.params.n if q.sample_index == 0 and q.num_output_tokens == 0 else 1
                samples.append((q, len(rows), count))
                rows.extend((i, j) for j in range(count))
        q_lens = np.asarray(q_lens, np.int32)
        starts = np.asarray(starts, np.int32)
        t = int(q_lens.sum())
        t_pad, s_pad, n_pad = self.buckets(t, s, len(rows))

        tokens = np.zeros(t_pad, np.int32)
        tokens[:t] = list(itertools.chain.from_iterable(token_chunks))
        cu = np.full(s_pad + 1, t, np.int32)
        cu[0] = 0
        np.cumsum(q_lens, out=cu[1:s + 1])
        owner = np.repeat(np.arange(s), q_lens)
        positions = np.zeros(t_pad, np.int32)
        positions[:t] = np.arange(t) - cu[owner] + starts[owner]
        widths = np.fromiter(map(len, tables), np.int64, s)
        page_indices = np.full((s_pad, self.pages_per_seq), NULL_PAGE, np.int32)
        page_indices[:s][np.arange(self.pages_per_seq) < widths[:, None]] = list(
            itertools.chain.from_iterable(tables))
        slots = np.full(t_pad, NULL_PAGE * page_size, np.int32)
        slots[:t] = page_indices[owner, positions[:t] // page_size] * page_size + positions[:t] % page_size
        kv_lens = np.zeros(s_pad, np.int32)
        kv_lens[:s] = starts + q_lens

        n_rows = len(rows)
        sample_rows = np.zeros(n_pad, np.int32)
        temperature = np.zeros(n_pad, np.float32)
        top_k = np.zeros(n_pad, np.int32)
        top_p = np.ones(n_pad, np.float32)
        seed = np.zeros(n_pad, np.int32)
        sample_index = np.zeros(n_pad, np.int32)
        sample_pos = np.zeros(n_pad, np.int32)
        if n_rows:
            idx = np.fromiter((r[0] for r in rows), np.int64, n_rows)
            sample_rows[:n_rows] = cu[idx + 1] - 1
            sample_pos[:n_rows] = kv_lens[idx]
            params = [seqs[i].params for i, _ in rows]
            temperature[:n_rows] = [p.temperature for p in params]
            top_k[:n_rows] = [p.top_k for p in params]
            top_p[:n_rows] = [p.top_p for p in params]
            seed[:n_rows] = [seqs[i].seed for i, _ in rows]
            sample_index[:n_rows] = [seqs[i].sample_index + j for i, j in rows]

        md = AttentionMetadata(slot_mapping=slots, page_indices=page_indices, kv_lens=kv_lens,
                               cu_q_lens=cu, num_seqs=np.array([s], np.int32))
        device = DeviceBatch(tokens=tokens, positions=positions, md=md, sample_rows=sample_rows,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                             sample_index=sample_index, sample_pos=sample_pos)
        return StepBatch(device=device, samples=samples, num_tokens=t, num_seqs=s)
