"""Test helpers: float64 numpy ground truth and paged cases whose unused storage is NaN.

Used by the kernel tests and the benchmark's correctness check. The numpy functions loop over
sequences and slice exactly the valid keys, so they cannot read a NaN by construction; a kernel that
reads past a length or into an unused page turns its output NaN and fails the comparison.
"""

from __future__ import annotations

import dataclasses

import numpy as np

NULL_PAGE = 0  # page 0 is never given to a sequence (the null page); the tests fill it with NaN


def _attend64(q, k, v, *, sm_scale, soft_cap):
    """q [G, D] (or [Tq, G, D] flattened by caller); k, v [S, D] -> [G, D] float64."""
    if k.shape[0] == 0:
        return np.zeros_like(q)
    s = (q @ k.T) * sm_scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def _seq_kv(pages, table_row, length):
    """[Hkv, P, page, D] pages -> [Hkv, length, D] float64 of one sequence (valid keys only)."""
    page = pages.shape[2]
    n_pages = -(-length // page)
    kv = pages[:, table_row[:n_pages]].reshape(pages.shape[0], n_pages * page, pages.shape[3])
    return kv[:, :length].astype(np.float64)


def _window(pos: int, sliding_window: int | None) -> int:
    """First key the query at ``pos`` sees."""
    return 0 if sliding_window is None else max(pos + 1 - sliding_window, 0)


def paged_attention_np(q, k_pages, v_pages, lengths, page_indices, *, sm_scale=1.0, soft_cap=None,
                       sliding_window=None):
    """float64 numpy paged decode attention; q [B, Hq, D] -> [B, Hq, D] float64.

    Only the pages a sequence reads are converted to float64, so a few sequences of a large pool
    stay cheap. ``sliding_window`` W: the query sees the last W keys only."""
    q, k_pages, v_pages = np.asarray(q, np.float64), np.asarray(k_pages), np.asarray(v_pages)
    lengths, page_indices = np.asarray(lengths), np.asarray(page_indices)
    batch, hq, d = q.shape
    hkv = k_pages.shape[0]
    out = np.zeros((batch, hq, d))
    for b in range(batch):
        k = _seq_kv(k_pages, page_indices[b], int(lengths[b]))
        v = _seq_kv(v_pages, page_indices[b], int(lengths[b]))
        lo = _window(int(lengths[b]) - 1, sliding_window)
        for h in range(hkv):
            g = hq // hkv
            out[b, h * g : (h + 1) * g] = _attend64(
                q[b, h * g : (h + 1) * g], k[h, lo:], v[h, lo:], sm_scale=sm_scale,
                soft_cap=soft_cap,
            )  # fmt: skip
    return out


def ragged_paged_attention_np(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=1.0, soft_cap=None,
    sliding_window=None,
):
    """float64 numpy ragged causal attention; q [T, Hq, D] -> [T, Hq, D] float64 (padding zeros).
    Converts only the pages each sequence reads."""
    q, k_pages, v_pages = np.asarray(q, np.float64), np.asarray(k_pages), np.asarray(v_pages)
    kv_lens, page_indices, cu = (np.asarray(x) for x in (kv_lens, page_indices, cu_q_lens))
    n = int(np.asarray(num_seqs).reshape(-1)[0])
    hq, hkv = q.shape[1], k_pages.shape[0]
    g = hq // hkv
    out = np.zeros(q.shape)
    for i in range(n):
        kv_len, q_len = int(kv_lens[i]), int(cu[i + 1] - cu[i])
        k = _seq_kv(k_pages, page_indices[i], kv_len)
        v = _seq_kv(v_pages, page_indices[i], kv_len)
        for r in range(q_len):
            t = int(cu[i]) + r
            pos = kv_len - q_len + r
            lo, hi = _window(pos, sliding_window), max(pos + 1, 0)
            for h in range(hkv):
                out[t, h * g : (h + 1) * g] = _attend64(
                    q[t, h * g : (h + 1) * g], k[h, lo:hi], v[h, lo:hi],
                    sm_scale=sm_scale, soft_cap=soft_cap,
                )  # fmt: skip
    return out


def flash_attention_np(q, k, v, *, kv_lens=None, causal=True, sm_scale=1.0, soft_cap=None):
    """float64 numpy contiguous attention; q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] -> float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, hq, _ = q.shape
    kv_len, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    lens = np.full(batch, kv_len) if kv_lens is None else np.minimum(np.asarray(kv_lens), kv_len)
    out = np.zeros(q.shape)
    for b in range(batch):
        for i in range(q_len):
            hi = int(lens[b])
            if causal:
                hi = min(hi, max(int(lens[b]) - q_len + i + 1, 0))
            for h in range(hkv):
                out[b, i, h * g : (h + 1) * g] = _attend64(
                    q[b, i, h * g : (h + 1) * g], k[b, :hi, h], v[b, :hi, h],
                    sm_scale=sm_scale, soft_cap=soft_cap,
                )  # fmt: skip
    return out


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """A paged KV pool plus per-sequence tables, as numpy arrays; unused storage is NaN."""

    k_pages: np.ndarray  # [Hkv, P, page, D]
    v_pages: np.ndarray  # [Hkv, P, page, D]
    lengths: np.ndarray  # i32[S]
    page_indices: np.ndarray  # i32[S, pages_per_seq]
    k_dense: np.ndarray  # [S, pages_per_seq * page, Hkv, D] the same keys, contiguous (NaN tail)
    v_dense: np.ndarray  # [S, pages_per_seq * page, Hkv, D]


def make_paged_case(
    rng: np.random.Generator,
    lengths,
    *,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    extra_pages: int = 3,
    dtype=np.float32,
) -> PagedCase:
    """Scatters random KV for sequences of ``lengths`` into a shuffled page pool.

    Page 0 (the null page), the ``extra_pages`` spare pages, table entries past each length (they
    point at the null page) and slots past each length inside a sequence's last page all hold NaN.
    ``dtype`` may be a numpy dtype or ``"bfloat16"`` (values are rounded to it via ml_dtypes).
    """
    lengths = np.asarray(lengths, np.int32)
    if np.any(lengths > pages_per_seq * page_size):
        raise ValueError(f"{lengths=} exceed {pages_per_seq=} * {page_size=}")
    num_seqs = len(lengths)
    used = [-(-int(n) // page_size) for n in lengths]
    num_pages = 1 + sum(used) + extra_pages
    perm = rng.permutation(np.arange(1, num_pages))
    page_indices = np.full((num_seqs, pages_per_seq), NULL_PAGE, np.int32)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages, v_pages = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    dense_shape = (num_seqs, pages_per_seq * page_size, num_kv_heads, head_dim)
    k_dense, v_dense = (
        np.full(dense_shape, np.nan, np.float32),
        np.full(dense_shape, np.nan, np.float32),
    )
    nxt = 0
    for s, n in enumerate(lengths):
        n = int(n)
        page_indices[s, : used[s]] = perm[nxt : nxt + used[s]]
        nxt += used[s]
        k = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        k_dense[s, :n], v_dense[s, :n] = k, v
        ids = page_indices[s, : used[s]]
        for src, dst in ((k_dense, k_pages), (v_dense, v_pages)):
            block = src[s, : used[s] * page_size].reshape(
                used[s], page_size, num_kv_heads, head_dim
            )
            dst[:, ids] = block.transpose(2, 0, 1, 3)  # NaN tail of the last page comes along
    cast = _caster(dtype)
    return PagedCase(
        cast(k_pages), cast(v_pages), lengths, page_indices, cast(k_dense), cast(v_dense)
    )


def _caster(dtype):
    if str(dtype) == "bfloat16":
        import ml_dtypes

        return lambda x: x.astype(ml_dtypes.bfloat16)
    return lambda x: x.astype(dtype)


def random_q(rng: np.random.Generator, shape, dtype=np.float32) -> np.ndarray:
    """Standard-normal queries in ``dtype`` (numpy dtype or ``"bfloat16"``)."""
    return _caster(dtype)(rng.standard_normal(shape).astype(np.float32))


def make_ragged_case(
    rng: np.random.Generator,
    seqs,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    idle_slots: int = 1,
    pad_tokens: int = 3,
    dtype=np.float32,
):
    """A ragged batch: ``seqs`` is a list of ``(kv_len, q_len)``; then ``idle_slots`` unused slots.

    Returns:
      ``(q, case, cu_q_lens, num_seqs)`` with ``q`` [sum(q_len) + pad_tokens, Hq, D] (padding rows
      last), ``case`` a :class:`PagedCase` over all slots (idle slots hold ``page_size`` keys that
      must be ignored), ``cu_q_lens`` i32[slots + 1] flat past ``num_seqs``, ``num_seqs`` i32[1].
    """
    lengths = [kv for kv, _ in seqs] + [page_size] * idle_slots
    case = make_paged_case(
        rng, lengths, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        pages_per_seq=pages_per_seq, dtype=dtype,
    )  # fmt: skip
    cu = np.zeros(len(lengths) + 1, np.int32)
    cu[1 : len(seqs) + 1] = np.cumsum([q_len for _, q_len in seqs])
    cu[len(seqs) + 1 :] = cu[len(seqs)]
    q = random_q(rng, (int(cu[-1]) + pad_tokens, num_q_heads, head_dim), dtype)
    return q, case, cu, np.asarray([len(seqs)], np.int32)


def mixed_batch(page_size: int, pages_per_seq: int) -> list[tuple[int, int]]:
    """``(kv_len, q_len)`` pairs covering every kind of row the ragged op serves.

    A prefill from empty, a mid-sequence prefill chunk, decodes at page boundaries +-1, a decode of
    a one-token sequence, a 4-token verification ending at the last slot of the table, and an
    empty slot (``q_len = 0``) in the middle.
    """
    top = page_size * pages_per_seq
    return [
        (min(13, top), min(13, top)),
        (min(2 * page_size + 1, top), 5),
        (page_size - 1, 1),
        (page_size, 1),
        (0, 0),
        (page_size + 1, 1),
        (1, 1),
        (top, 4),
    ]


@dataclasses.dataclass
class CascadeCase:
    """A decode batch whose groups share prefix pages (see :func:`make_cascade_case`)."""

    q: np.ndarray  # [B, Hq, D]
    k_pages: np.ndarray  # [Hkv, P, page, D]
    v_pages: np.ndarray
    lengths: np.ndarray  # i32[B]
    page_indices: np.ndarray  # i32[B, pages_per_seq]
    group_rows: np.ndarray  # i32[NG, R], -1 padded
    prefix_lens: np.ndarray  # i32[NG]


def make_cascade_case(
    rng: np.random.Generator,
    groups,
    lone,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    num_groups: int | None = None,
    group_size: int | None = None,
    dtype=np.float32,
) -> CascadeCase:
    """Groups of sequences sharing prefix pages, plus sequences in no group, in a NaN pool.

    ``groups`` is a list of ``(prefix_pages, suffix_lengths)``: the group's members share
    ``prefix_pages`` physical pages, then each has ``suffix_lengths[i]`` tokens of its own (a
    partial last page included). ``lone`` lists the lengths of sequences in no group. Members and
    lone sequences are interleaved in a shuffled batch order. ``num_groups`` / ``group_size``
    pad ``group_rows`` (-1) and ``prefix_lens`` (0) beyond what ``groups`` needs.
    """
    members, prefixes, seq_lens = [], [], []
    for prefix, suffixes in groups:
        members.append(list(range(len(seq_lens), len(seq_lens) + len(suffixes))))
        prefixes.append(prefix)
        seq_lens += [prefix * page_size + int(s) for s in suffixes]
    seq_lens += [int(n) for n in lone]
    order = rng.permutation(len(seq_lens))  # batch slot of each sequence
    need = sum(p for p in prefixes) + sum(
        -(-(n - (prefixes[g] * page_size if g is not None else 0)) // page_size)
        for n, g in zip(seq_lens, [_group_of(i, members) for i in range(len(seq_lens))])
    )
    num_pages = 1 + need + 3
    free = list(rng.permutation(np.arange(1, num_pages)))
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages, v_pages = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    batch = len(seq_lens)
    page_indices = np.full((batch, pages_per_seq), NULL_PAGE, np.int32)
    lengths = np.zeros(batch, np.int32)

    def fill(ids, num_tokens):
        for pages in (k_pages, v_pages):
            kv = rng.standard_normal((num_kv_heads, len(ids) * page_size, head_dim))
            kv[:, num_tokens:] = np.nan
            pages[:, ids] = kv.reshape(num_kv_heads, len(ids), page_size, head_dim)

    shared = [[int(free.pop()) for _ in range(p)] for p in prefixes]
    for ids in shared:
        fill(ids, len(ids) * page_size)
    for i, n in enumerate(seq_lens):
        g = _group_of(i, members)
        head = shared[g] if g is not None else []
        own = -(-(n - len(head) * page_size) // page_size)
        ids = [int(free.pop()) for _ in range(own)]
        fill(ids, n - len(head) * page_size)
        table = head + ids
        if len(table) > pages_per_seq:
            raise ValueError(f"sequence of {n} tokens needs {len(table)} > {pages_per_seq=}")
        page_indices[order[i], : len(table)] = table
        lengths[order[i]] = n
    num_groups = num_groups or max(1, len(groups))
    group_size = group_size or max([1] + [len(m) for m in members])
    group_rows = np.full((num_groups, group_size), -1, np.int32)
    prefix_lens = np.zeros(num_groups, np.int32)
    for g, (m, p) in enumerate(zip(members, prefixes)):
        group_rows[g, : len(m)] = order[m]
        prefix_lens[g] = p * page_size
    q = random_q(rng, (batch, num_q_heads, head_dim), dtype)
    cast = _caster(dtype)
    return CascadeCase(q, cast(k_pages), cast(v_pages), lengths, page_indices, group_rows,
                       prefix_lens)


def _group_of(i: int, members) -> int | None:
    return next((g for g, m in enumerate(members) if i in m), None)
