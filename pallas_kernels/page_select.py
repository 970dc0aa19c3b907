"""Query-aware page selection (Quest, Tang et al. 2024) over a paged KV cache.

Each page keeps, per KV head, the element-wise minimum and maximum of its keys (its *bounds*,
``[.., 2, D]``: row 0 the minimum, row 1 the maximum), updated by the KV write
(:func:`update_bounds`). At decode, ``sum_d max(q_d * min_d, q_d * max_d)`` bounds from above
the score ``q . k`` of every key of the page; :func:`select_pages` keeps the top pages of each
(sequence, KV head) plus, always, the first (sink) and the last (open) page, and
:func:`sparse_paged_attention` feeds the selected pages to the ordinary decode kernel.

GQA (``gqa``, :data:`GQA_MODES`): a KV head's query group reads one page list. ``"max"``: a
page's score is the maximum of the group's query heads' bounds (``k`` pages). ``"rank"``: each
query head ranks the pages by its own bound (Quest scores per query head) and the group reads
``k`` pages, the best-ranked of any head first (the heads' lists merged round-robin; same bytes
as ``"max"``). ``"union"``: the union of each query head's own top ``k`` (Quest's per-head
selection, each page read once for the group): ``k`` to ``G * (k - 2) + 2`` pages, more bytes.

Recent pages (``recent``, default 0): the last ``recent`` pages before the open page are kept
like the sink and the open page, inside the budget (a row keeps ``min(recent, k - 2)`` of them,
the nearest first; the top pages by score fill what is left), so the pages read do not grow.

Per-head page lists reach the unchanged kernels as pseudo-sequences: the pool
``[Hkv, P, page, D]`` is viewed as one KV head of ``Hkv * P`` pages (a free reshape), and
(sequence ``s``, KV head ``h``) becomes row ``s * Hkv + h`` with the ``G`` query heads of its
group and the page ids ``h * P + p``. Every kernel style then reads exactly the selected pages.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0
GQA_MODES = ("max", "rank", "union")


def init_bounds(shape, dtype):
    """Empty bounds ``[.., 2, D]``: minimum +inf, maximum -inf."""
    lo = jnp.full(shape[:-2] + (1, shape[-1]), jnp.inf, dtype)
    return jnp.concatenate([lo, -lo], axis=-2)


def update_bounds(
    bounds: jax.Array,  # [L, Hkv, P, 2, D]
    k_pages,  # [L, Hkv, P, page, D] (or quant.QuantizedPages), this step's keys already written
    slot_mapping: jax.Array,  # i32[T]: page * page_size + offset of each written token
) -> jax.Array:  # [L, Hkv, P, 2, D]
    """Folds the keys written at ``slot_mapping`` into their pages' bounds (traceable).

    Quantized pages (int8 / fp8 with scales): the bounds are of the keys as the kernels read
    them back (values times their scale, ``quant.dequantize_tile``), so they bound the scores
    the kernels compute.

    A token at offset 0 opens its page: that page's bounds restart from this step's tokens
    (whatever the page held before, e.g. for another sequence, no longer counts). Tokens of a
    sequence are written in order, so every later token of the page folds into bounds that
    already cover the page's earlier tokens. Padding tokens (slots in the null page) change only
    the null page's bounds, which nothing reads.
    """
    from pallas_kernels import quant

    values, scales = quant.split(k_pages)
    num_layers, num_kv_heads, num_pages, page_size, head_dim = values.shape
    slots = slot_mapping.astype(jnp.int32)
    page, offset = slots // page_size, slots % page_size
    flat = values.reshape(num_layers, num_kv_heads, num_pages * page_size, head_dim)
    keys = flat[:, :, slots]  # [L, Hkv, T, D]
    if scales is not None:  # [L, Hkv, P, S]: S = page (per token) or 1 (per page)
        at = offset if scales.shape[-1] == page_size else jnp.zeros_like(offset)
        keys = quant.dequantize_tile(keys, scales[:, :, page, at])
    keys = keys.astype(bounds.dtype)
    opened = jnp.where(offset == 0, page, num_pages)  # out of range: dropped
    empty = init_bounds((num_layers, num_kv_heads, slots.shape[0], 2, head_dim), bounds.dtype)
    bounds = bounds.at[:, :, opened].set(empty, mode="drop")
    bounds = bounds.at[:, :, page, 0].min(keys, mode="drop")
    return bounds.at[:, :, page, 1].max(keys, mode="drop")


def head_scores(
    q: jax.Array,  # [S, Hkv, G, D]
    bounds: jax.Array,  # [Hkv, P, 2, D]
    page_indices: jax.Array,  # i32[S, W]
) -> jax.Array:  # f32[S, Hkv, G, W]
    """Upper bound of ``q . k`` over each page in the table, per query head:
    ``sum_d max(q_d min_d, q_d max_d)``."""
    b = bounds[:, page_indices].astype(jnp.float32)  # [Hkv, S, W, 2, D]
    qf = q.astype(jnp.float32)
    lo = jnp.einsum("shgd,hswd->shgwd", qf, b[..., 0, :])
    hi = jnp.einsum("shgd,hswd->shgwd", qf, b[..., 1, :])
    return jnp.sum(jnp.maximum(lo, hi), axis=-1)


def page_scores(q, bounds, page_indices) -> jax.Array:  # f32[S, Hkv, W]
    """:func:`head_scores` maximised over the query group (``gqa="max"``)."""
    return jnp.max(head_scores(q, bounds, page_indices), axis=2)


def head_ranks(scores: jax.Array) -> jax.Array:  # i32[..., G, W]
    """Each page's place in its query head's order (0 = highest score; ties to the lower page,
    as ``lax.top_k``) of ``scores [..., G, W]``."""
    order = jnp.argsort(-scores, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True).astype(jnp.int32)


def best_rank(ranks: jax.Array) -> jax.Array:  # i32[..., W]
    """``ranks [..., G, W]`` merged over the group: the best (lowest) rank any head gives a page,
    times G plus that head (a strict order: ``"rank"`` takes pages in it)."""
    g = ranks.shape[-2]
    head = jnp.arange(g, dtype=jnp.int32)[:, None]
    return jnp.min(ranks * g + head, axis=-2)


def check_gqa(gqa: str) -> None:
    if gqa not in GQA_MODES:
        raise ValueError(f"gqa={gqa!r} must be one of {GQA_MODES}")


def recent_window(keep: jax.Array, recent: int) -> jax.Array:
    """How many pages before the open page a row with budget ``keep`` (pages, sink and open
    page included) keeps unconditionally: ``min(recent, keep - 2)``, at least 0."""
    return jnp.clip(keep - 2, 0, int(recent)).astype(jnp.int32)


def table_width(budget: float, width: int, group: int = 1, gqa: str = "max") -> int:
    """Static width of the selected table: the most pages any row of a ``width``-page table
    may read under ``budget`` (pages if an int, else a fraction); with ``gqa="union"`` the
    union of ``group`` heads' lists (each sharing the first and last page)."""
    if isinstance(budget, float):
        n = min(width, max(2, math.ceil(budget * width)))
    else:
        n = min(width, int(budget))
    if gqa == "union" and n > 2:
        n = min(width, group * (n - 2) + 2)
    return n


def select_pages(
    q: jax.Array,  # [S, Hkv, G, D] one decode query per sequence
    bounds: jax.Array,  # [Hkv, P, 2, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, W]
    active: jax.Array,  # bool[S]: rows that select (others get length 0)
    *,
    page_size: int,
    budget: float,
    gqa: str = "max",
    recent: int = 0,
) -> tuple[jax.Array, jax.Array]:  # i32[S, Hkv, n], i32[S, Hkv]
    """Each active row's pages to read, per KV head, in logical order.

    Budget ``k`` pages (an int), or ``max(2, ceil(budget * pages))`` for a float fraction; the
    first page and the last (the one the query's own token is in) are always kept, then the
    highest :func:`page_scores` (``gqa="max"``), or the pages by their best rank in any query
    head (``"rank"``), or every page some query head ranks within its own top ``k``
    (``"union"``: up to ``G * (k - 2) + 2`` pages; module docstring). ``recent``: the last
    ``min(recent, k - 2)`` pages before the open page are kept too, inside the ``k``. A row
    with at most ``k`` pages keeps them all, in order: the table is its dense one.

    Returns:
      ``(table, lengths)``: ``table[s, h, :c]`` the physical pages kept (logical order, the last
      page last; ``NULL_PAGE`` past ``c``) and ``lengths[s, h]`` the keys they hold,
      ``(c - 1) * page_size`` plus the last page's filled tokens (0 for inactive rows).
    """
    check_gqa(gqa)
    rows, width = page_indices.shape
    group = q.shape[2]
    n = table_width(budget, width, group, gqa)
    num_pages = (kv_lens + page_size - 1) // page_size  # [S]
    if isinstance(budget, float):
        keep = jnp.maximum(2, jnp.ceil(budget * num_pages).astype(jnp.int32))
    else:
        keep = jnp.full_like(num_pages, int(budget))
    keep = jnp.where(active, jnp.minimum(keep, num_pages), 0)  # [S]
    j = jnp.arange(width, dtype=jnp.int32)
    first_forced = num_pages - 1 - recent_window(keep, recent)  # the window, then the open page
    forced = (j == 0)[None, :] | ((j[None, :] >= first_forced[:, None])
                                  & (j[None, :] < num_pages[:, None]))  # [S, W]
    live = j[None, :] < num_pages[:, None]
    scores = head_scores(q, bounds, page_indices)  # [S, Hkv, G, W]
    scores = jnp.where(forced[:, None, None], jnp.inf, scores)
    scores = jnp.where(live[:, None, None], scores, -jnp.inf)  # NaN bounds of dead pages: gone
    if gqa == "union":  # a page in any head's own top `keep` (the forced pages rank first)
        kept_page = jnp.min(head_ranks(scores), axis=2) < keep[:, None, None]  # [S, Hkv, W]
        logical = jnp.sort(jnp.where(kept_page, j, width), axis=-1)[..., :n]
        count = jnp.sum(kept_page, axis=-1, dtype=jnp.int32)  # [S, Hkv]
    else:
        order = (jnp.max(scores, axis=2) if gqa == "max"
                 else -best_rank(head_ranks(scores)).astype(jnp.float32))
        keep = jnp.minimum(keep, n)
        _, top = jax.lax.top_k(order, n)  # [S, Hkv, n], best first
        rank = jnp.arange(n, dtype=jnp.int32)
        kept = rank[None, None, :] < keep[:, None, None]
        logical = jnp.sort(jnp.where(kept, top, width), axis=-1)  # kept first, ascending
        count = jnp.broadcast_to(keep[:, None], logical.shape[:2])
    table = jnp.take_along_axis(page_indices[:, None, :], jnp.minimum(logical, width - 1), axis=2)
    table = jnp.where(logical < width, table, NULL_PAGE)
    last = kv_lens - (num_pages - 1) * page_size  # filled tokens of the last page
    lengths = jnp.where(count > 0, (count - 1) * page_size + last[:, None], 0)
    return table.astype(jnp.int32), lengths.astype(jnp.int32)


def heads_as_pages(pages, layer=None):
    """A ``[(L,) Hkv, P, ...]`` pool (or a pytree of such leaves) viewed as one KV head of
    ``Hkv * P`` pages: ``[(L,) 1, Hkv * P, ...]`` (a reshape, no copy)."""
    axis = 0 if layer is None else 1

    def one(x):
        shape = x.shape
        return x.reshape(*shape[:axis], 1, shape[axis] * shape[axis + 1], *shape[axis + 2:])

    return jax.tree.map(one, pages)


def flatten_selection(
    q: jax.Array,  # [S, Hq, D]
    table: jax.Array,  # i32[S, Hkv, n]
    lengths: jax.Array,  # i32[S, Hkv]
    num_pages: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The pseudo-sequences of the module docstring: ``(q [S * Hkv, G, D], table i32[S * Hkv,
    n], lengths i32[S * Hkv])`` for the one-head view of :func:`heads_as_pages`."""
    rows, num_kv_heads, n = table.shape
    head = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    flat_table = (table + head * num_pages).reshape(rows * num_kv_heads, n)
    qg = q.reshape(rows * num_kv_heads, q.shape[1] // num_kv_heads, q.shape[2])
    return qg, flat_table, lengths.reshape(-1)


def sparse_paged_attention(
    q: jax.Array,  # [S, Hq, D]
    k_pages,  # [Hkv, P, page, D], or [L, Hkv, ...] with `layer`
    v_pages,  # same shape as k_pages
    bounds: jax.Array,  # [Hkv, P, 2, D], or [L, Hkv, P, 2, D] with `layer`
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, W]
    active: jax.Array,  # bool[S]
    *,
    budget: float,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    impl: str = "auto",
    layer=None,
    config=None,
    op: str = "paged",
    gqa: str = "max",
    recent: int = 0,
) -> jax.Array:  # [S, Hq, D]
    """Decode attention over the selected pages only (:func:`select_pages`), through
    ``pallas_kernels.paged_attention`` (``op="paged"``) or the ragged kernel
    (``op="ragged"``: each pseudo-sequence one query row) with any ``impl``; ``gqa`` and
    ``recent`` as in :func:`select_pages`. Inactive rows give zeros. Equal to ``paged_attention`` (float rounding aside) when the budget covers every
    row's pages."""
    from pallas_kernels import api

    if op not in ("paged", "ragged"):
        raise ValueError(f"op={op!r} must be 'paged' or 'ragged'")

    num_kv_heads, num_pages, page_size = _pool_dims(k_pages, layer)
    if layer is not None:
        bounds = bounds[layer]
    qs = q.reshape(q.shape[0], num_kv_heads, -1, q.shape[-1])
    table, lengths = select_pages(qs, bounds, kv_lens, page_indices, active,
                                  page_size=page_size, budget=budget, gqa=gqa,
                                  recent=recent)
    qf, flat_table, flat_lens = flatten_selection(q, table, lengths, num_pages)
    kp, vp = heads_as_pages(k_pages, layer), heads_as_pages(v_pages, layer)
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, impl=impl, layer=layer, config=config)
    if op == "paged":
        out = api.paged_attention(qf, kp, vp, flat_lens, flat_table, **kw)
    else:
        out = _ragged(qf, kp, vp, flat_lens, flat_table, kw)
    return out.reshape(q.shape)


def _ragged(qf, kp, vp, lens, table, kw):
    """The pseudo-sequences through ``ragged_paged_attention``, one query row each: the live
    rows (``lens > 0``) packed first (a ragged sequence reads at least its query's key), the
    rest padding rows, which give zeros; outputs back in row order."""
    from pallas_kernels import api

    live = lens > 0
    order = jnp.argsort(~live, stable=True)  # live rows first, in order
    n = jnp.sum(live, dtype=jnp.int32)
    cu = jnp.minimum(jnp.arange(lens.shape[0] + 1, dtype=jnp.int32), n)
    out = api.ragged_paged_attention(qf[order], kp, vp, lens[order], table[order], cu,
                                     n.reshape(1), **kw)
    return jnp.zeros_like(out).at[order].set(out)


def _pool_dims(pages, layer) -> tuple[int, int, int]:
    shape = jax.tree.leaves(pages)[0].shape
    shape = shape if layer is None else shape[1:]
    return shape[0], shape[1], shape[2]


def bytes_read(kv_lens, lengths, *, page_size: int, head_dim: int, itemsize: int) -> dict:
    """K/V bytes one layer's decode step reads, counted in whole pages: ``dense`` (every page
    of every KV head), ``selected_kv`` (the pages of :func:`select_pages`' ``lengths``),
    ``bounds`` (the 2 bound rows of every page, which the scores read; same itemsize) and
    ``sparse = selected_kv + bounds``.

    Args:
      kv_lens: i32[S] tokens per sequence; lengths: i32[S, Hkv] keys selected per KV head.
    """
    kv, sel = np.asarray(kv_lens, np.int64), np.asarray(lengths, np.int64)
    pages = int((-(-kv // page_size)).sum()) * sel.shape[1]
    page_bytes = 2 * page_size * head_dim * itemsize
    selected = int((-(-sel // page_size)).sum()) * page_bytes
    bounds = pages * 2 * head_dim * itemsize
    return {"dense": pages * page_bytes, "selected_kv": selected, "bounds": bounds,
            "sparse": selected + bounds}


def dense_selection_mask(
    q: jax.Array,  # [B, Tq, Hq, D] the queries (after RoPE) of the last Tq positions
    k: jax.Array,  # [B, T, Hkv, D] the keys of every position
    *,
    page_size: int,
    budget: float,
    gqa: str = "max",
    recent: int = 0,
) -> jax.Array:  # bool[B, Hkv, Tq, T]
    """What each position would read if it were a decode row (the no-cache reference of
    :func:`select_pages`, for teacher-forced perplexity): ``mask[b, h, t, s]`` is True where
    key ``s <= t`` lies in a page that position ``t``'s selection keeps for KV head ``h``
    (``t`` over the last ``Tq`` positions: every position when ``Tq = T``).

    Position ``t`` holds ``t // page_size + 1`` pages; it keeps the first and its own (last)
    page and the ``keep - 2`` highest-scoring pages between them (``keep`` as in
    :func:`select_pages`), scored by :func:`page_scores`' bound on each full page, or by the
    query heads' ranks (``gqa``, as :func:`select_pages`); with ``recent``, the
    ``min(recent, keep - 2)`` pages before its own are kept too and the top pages fill the
    rest. Ties go to the lower page, as ``lax.top_k``."""
    check_gqa(gqa)
    b, tq, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    pages = -(-t // page_size)
    kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, pages * page_size - t), (0, 0), (0, 0)),
                 mode="edge").reshape(b, pages, page_size, hkv, d)  # edge: no new extremes
    lo, hi = kp.min(axis=2), kp.max(axis=2)  # [B, P, Hkv, D]
    qg = q.astype(jnp.float32).reshape(b, tq, hkv, hq // hkv, d)
    # sum_d max(q_d lo_d, q_d hi_d) = relu(q) . hi + min(q, 0) . lo  (hi >= lo)
    score = (jnp.einsum("btkgd,bpkd->bktgp", jnp.maximum(qg, 0), hi)
             + jnp.einsum("btkgd,bpkd->bktgp", jnp.minimum(qg, 0), lo))  # [B, Hkv, T, G, P]
    pos = jnp.arange(t, dtype=jnp.int32)
    qpos = pos[t - tq:]
    last = qpos // page_size  # [Tq]
    num_pages = last + 1
    if isinstance(budget, float):
        keep = jnp.maximum(2, jnp.ceil(budget * num_pages).astype(jnp.int32))
    else:
        keep = jnp.full_like(num_pages, int(budget))
    keep = jnp.minimum(keep, num_pages)
    window = recent_window(keep, recent)  # [Tq]
    p = jnp.arange(pages, dtype=jnp.int32)
    near = (p[None, :] >= last[:, None] - window[:, None]) & (p[None, :] < last[:, None])
    between = (p[None, :] >= 1) & (p[None, :] < last[:, None]) & ~near  # [Tq, P]
    score = jnp.where(between[:, None], score, -jnp.inf)
    if gqa == "max":
        rank = head_ranks(score.max(axis=3))  # a page's place in its row's order
    elif gqa == "rank":
        rank = head_ranks(-best_rank(head_ranks(score)).astype(jnp.float32))
    else:  # "union": in some head's own top
        rank = jnp.min(head_ranks(score), axis=3)
    kept = (between & (rank < (keep - 2 - window)[:, None])) | (p[None, :] == 0) | (
        p[None, :] == last[:, None]) | near  # [B, Hkv, T, P]
    mask = jnp.take(kept, pos // page_size, axis=-1)  # [B, Hkv, Tq, T]
    return mask & (pos[None, :] <= qpos[:, None])


@functools.partial(jax.jit, static_argnames=("page_size", "budget", "gqa", "recent"))
def select_pages_jit(q, bounds, kv_lens, page_indices, active, *, page_size, budget, gqa="max",
                     recent=0):
    """:func:`select_pages`, jitted (the small function a study or a test calls directly)."""
    return select_pages(q, bounds, kv_lens, page_indices, active, page_size=page_size,
                        budget=budget, gqa=gqa, recent=recent)


__all__ = ["GQA_MODES", "best_rank", "bytes_read", "check_gqa", "dense_selection_mask",
           "flatten_selection", "head_ranks", "head_scores", "heads_as_pages", "init_bounds",
           "page_scores", "recent_window", "select_pages", "select_pages_jit", "sparse_paged_attention",
           "table_width", "update_bounds"]
