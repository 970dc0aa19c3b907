"""The ``impl="xla"`` path: blocked online-softmax attention in plain jnp, the fast path on CPU.

Unlike the references, nothing here materialises a whole sequence's KV or its full score row: a
``lax.fori_loop`` walks the keys in blocks of ``block_tokens`` (gathering only that block's pages per
row, keys in (slot, page) order so the copy streams all of the block's pages at once), keeps a
running max / sum / accumulator in float32 (the online-softmax step of
:mod:`pallas_kernels.softmax`, which the Pallas kernels use too), and stops after the last block
any row can see (the trip count is traced, so short batches in a long page table cost only what
they use).
Quantized pages (:mod:`pallas_kernels.quant`) are dequantized per gathered block, never whole.
Positions at or past a row's limit are masked with ``jnp.where`` in scores *and* values, so NaN
garbage there never reaches the output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import quant, reference, softmax, validation
from pallas_kernels.xla_mass import _seen, attention_mass


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """Tuning knobs of the XLA path.

    Attributes:
      block_tokens: keys processed per loop iteration (rounded down to whole pages, at least one).
      max_score_elements: cap on the float32 score tile of ``flash_attention`` (shrinks its key block).
      ragged_chunk: query rows of one sequence that share a KV gather in ``ragged_paged_attention``
        (decode rows waste ``ragged_chunk - 1`` slots of cheap compute; prefill rows save
        ``ragged_chunk`` x the gathers).
      items_per_group: rows (decode sequences, ragged work items) processed together; small
        groups keep the gathered KV block in cache, and the loop stops after the last live row.
    """

    block_tokens: int = 128
    max_score_elements: int = 1 << 23
    ragged_chunk: int = 8
    items_per_group: int = 4

    def __post_init__(self):
        if not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise ValueError(f"block_tokens={self.block_tokens!r} must be a positive int")
        for name in ("ragged_chunk", "items_per_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if not isinstance(self.max_score_elements, int) or self.max_score_elements < 1:
            raise ValueError(
                f"max_score_elements={self.max_score_elements!r} must be a positive int"
            )


def _in_loop(cache, *where):
    """``cache`` made to depend on the tile position ``where`` (no copy), for 2-byte floats.

    XLA:CPU has no bfloat16/float16 gather or slice: it converts the operand to float32, and the
    loop-invariant code motion then hoists that convert out of the loops, converting the whole
    cache (every layer, with ``layer=``) on each call (measured: bf16 decode 4x slower than
    float32). Behind the barrier the convert stays fused with the gather of the tile; ``where``
    must vary in every enclosing loop (XLA may drop an inner loop of one trip). Other backends
    gather 2-byte floats natively and get ``cache`` unchanged.
    """
    if cache.dtype == jnp.float32 or jax.default_backend() != "cpu":
        return cache
    return lax.optimization_barrier((cache, *where))[0]


def paged_rows_attention(
    q: jax.Array,  # [R, Hkv, M, D]
    k_pages: jax.Array,  # [Hkv, P, page, D]
    v_pages: jax.Array,  # [Hkv, P, page, D]
    row_pages: jax.Array,  # i32[R, pages_per_seq]
    row_limit: jax.Array,  # i32[R, M] or i32[R, 1]
    *,
    sm_scale: float,
    soft_cap: float | None,
    config: XlaConfig,
    layer=None,
    state: bool = False,
    sliding_window: int | None = None,
    mass_weight: jax.Array | None = None,  # f32[R, M]
    hole: jax.Array | None = None,  # i32[R, 2]
) -> jax.Array:  # f32[R, Hkv, M, D]
    """Query ``m`` of row ``r`` attends to keys ``[0, row_limit[r, m])`` of the pages ``row_pages[r]``
    (with ``sliding_window`` W: keys ``[row_limit - W, row_limit)``).

    The loop over key blocks runs from the first block any query of the rows can see to the
    last: with a window, blocks wholly behind every row's window are never gathered.

    With ``state=True`` returns the unnormalised online-softmax state instead, ``(m, l, acc)``
    f32 ``[R, Hkv, M]``, ``[R, Hkv, M]``, ``[R, Hkv, M, D]`` (what cascade attention merges).

    A row is one gather of KV (per block) shared by its ``M`` queries: a decode sequence's query
    heads, or a chunk of consecutive tokens of one sequence times their heads. With ``layer``,
    ``k_pages``/``v_pages`` are the stacked cache ``[L, Hkv, P, page, D]`` and blocks are gathered
    straight from layer ``layer`` (no copy of the layer).

    With ``mass_weight`` (f32[R, M], a weight per query) also returns each row's attention mass
    ``f32[R, Hkv, pages_per_seq * page]``: per key slot, the sum over the row's queries of
    weight x softmax probability (:func:`pallas_kernels.xla_mass.attention_mass`, a second pass over the keys). With
    ``hole`` (i32[R, 2]) row ``r``'s keys ``[hole[r, 0], hole[r, 1])`` are not seen.
    """
    rows, num_kv_heads, num_queries, head_dim = q.shape
    page_size = k_pages.shape[-2]
    pages_per_seq = row_pages.shape[1]
    pages_per_block = max(1, min(config.block_tokens // page_size, pages_per_seq))
    num_blocks = -(-pages_per_seq // pages_per_block)
    pad = num_blocks * pages_per_block - pages_per_seq
    if pad:  # padded entries are masked (beyond every limit); page 0 keeps the gather in bounds
        row_pages = jnp.pad(row_pages, ((0, 0), (0, pad)))
    block = pages_per_block * page_size
    row_limit = jnp.minimum(row_limit.astype(jnp.int32), pages_per_seq * page_size)
    row_max = jnp.max(row_limit, axis=1)  # [R] keys any query of the row sees
    trips = jnp.minimum((jnp.max(row_max) + block - 1) // block, num_blocks)
    lo = reference.window_start(row_limit, sliding_window)  # [R, M or 1] first key seen
    # First key any query of the row sees (queries that see nothing do not count).
    row_lo = jnp.min(jnp.where(row_limit > 0, lo, pages_per_seq * page_size), axis=1)  # [R]
    first = jnp.minimum(jnp.min(row_lo) // block, trips)
    lo = lo[None, :, :, None]  # [1, R, M or 1, 1]
    if hole is not None:  # folded into ``lo`` as a pair: keys seen are >= lo and not in the hole
        lo = (lo, hole[None, :, None, 0, None], hole[None, :, None, 1, None])
    # Work in [Hkv, R, ...]: the gather's natural layout, so no per-block transpose of K/V.
    qf = jnp.swapaxes(q, 0, 1).astype(jnp.float32)  # [Hkv, R, M, D]
    limit = row_limit[None, :, :, None]  # [1, R, M or 1, 1]

    # Keys of a block in (slot, page) order: the gather's inner loop then reads one D-row from
    # each of the block's pages in turn, so the CPU streams all of them at once instead of one
    # page after another (each page is a separate small run of memory; one at a time, every page
    # start waits on DRAM). Softmax does not care about key order; V uses the same order.
    # Measured on the CPU target (kernel_bench cpu): paged/dense 1.28 in page order, 0.93 here.
    offsets = jnp.arange(page_size, dtype=jnp.int32)[:, None]
    offsets = (offsets + page_size * jnp.arange(pages_per_block, dtype=jnp.int32)).reshape(-1)

    def body(i, carry):
        ids = lax.dynamic_slice_in_dim(row_pages, i * pages_per_block, pages_per_block, axis=1)

        def take(x):  # [(L,) Hkv, P, ...] -> [Hkv, R, pages_per_block, ...]
            x = _in_loop(x, ids)
            return x[:, ids] if layer is None else jnp.moveaxis(x[layer, :, ids], 2, 0)

        def gather(pages):  # -> f32[Hkv, R, block, D], keys in (slot, page) order
            # Quantized pages: the block's values and scales only, dequantized here.
            values, scales = quant.split(pages)
            g = quant.dequantize_tile(take(values), None if scales is None else take(scales))
            g = jnp.swapaxes(g, 2, 3)  # [Hkv, R, page, pages_per_block, D]
            return g.reshape(num_kv_heads, rows, block, head_dim)

        pos = i * block + offsets
        valid = _seen(pos, lo, limit)  # [1, R, M, block]
        v_valid = (pos[None, :] < row_max[:, None]) & (pos[None, :] >= row_lo[:, None])
        v_valid = v_valid[None, :, :, None]  # [1, R, block, 1]
        s = jnp.einsum("hrmd,hrkd->hrmk", qf, gather(k_pages))
        s = softmax.scale_scores(s, sm_scale=sm_scale, soft_cap=soft_cap)
        v = jnp.where(v_valid, gather(v_pages), 0.0)
        return softmax.online_softmax_step(carry, s, v, valid)

    init = softmax.initial_state((num_kv_heads, rows, num_queries), head_dim)
    m, lsum, acc = lax.fori_loop(first, trips, body, init)
    if mass_weight is not None:
        out = jnp.swapaxes(softmax.normalize(lsum, acc), 0, 1)
        return out, attention_mass(
            qf, k_pages, row_pages, (m, lsum), mass_weight, (lo, limit), (first, trips),
            sm_scale=sm_scale, soft_cap=soft_cap, layer=layer, pages_per_block=pages_per_block,
            pages_per_seq=pages_per_seq, in_loop=_in_loop)  # fmt: skip
    if state:
        return tuple(jnp.swapaxes(x, 0, 1) for x in (m, lsum, acc))
    return jnp.swapaxes(softmax.normalize(lsum, acc), 0, 1)


def grouped_rows_attention(q, k_pages, v_pages, row_pages, row_limit, count, *, config,
                           state=False, mass_weight=None, hole=None, **kw):  # fmt: skip
    """:func:`paged_rows_attention` over groups of ``config.items_per_group`` rows.

    Same arguments and result (f32[R, Hkv, M, D], or the state with ``state=True``), plus
    ``count`` (i32[]): the rows that are live, a prefix; the others are skipped and come out
    zero (state: ``m = -inf``, ``l = 0``, which weighs nothing in a merge; mass: 0). With
    ``mass_weight`` (f32[R, M]) returns ``(out, mass f32[R, Hkv, S])``. Small groups keep one
    group's gathered KV block in cache (several times faster on CPU than one batch-wide gather),
    and the loop stops after the last live row.
    """
    rows = q.shape[0]
    per_group = min(config.items_per_group, rows)
    num_groups = -(-rows // per_group)
    pad = num_groups * per_group - rows
    if pad:
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0)))
        row_pages = jnp.pad(row_pages, ((0, pad), (0, 0)))
        row_limit = jnp.pad(row_limit, ((0, pad), (0, 0)))
        if mass_weight is not None:
            mass_weight = jnp.pad(mass_weight, ((0, pad), (0, 0)))
        if hole is not None:
            hole = jnp.pad(hole, ((0, pad), (0, 0)))

    def body(g, out):
        sl = lambda x: lax.dynamic_slice_in_dim(x, g * per_group, per_group, axis=0)  # noqa: E731
        extra = {k: sl(x) for k, x in (("mass_weight", mass_weight), ("hole", hole))
                 if x is not None}
        o = paged_rows_attention(
            sl(q), k_pages, v_pages, sl(row_pages), sl(row_limit), config=config, state=state,
            **extra, **kw,
        )  # fmt: skip
        return jax.tree.map(
            lambda buf, x: lax.dynamic_update_slice_in_dim(buf, x, g * per_group, axis=0), out, o
        )

    out = jnp.zeros(q.shape, jnp.float32)
    if state:
        out = (jnp.full(q.shape[:3], -jnp.inf, jnp.float32), jnp.zeros(q.shape[:3], jnp.float32), out)
    elif mass_weight is not None:
        slots = row_pages.shape[1] * k_pages.shape[-2]
        out = (out, jnp.zeros((q.shape[0], q.shape[1], slots), jnp.float32))
    out = lax.fori_loop(0, (count + per_group - 1) // per_group, body, out)
    return jax.tree.map(lambda x: x[:rows], out)


def ragged_items(
    num_tokens: int,
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs,  # i32[1] | int
    chunk: int,
    select: jax.Array,  # bool[S]
    max_items: int,
) -> dict:
    """Cuts the query rows of each live, selected sequence into work items of <= ``chunk`` rows.

    ``max_items`` is the static bound on items (the live count is traced).

    Returns:
      dict of ``seq`` i32[W], ``rows`` i32[W, chunk] (token row of each slot, clamped),
      ``limit`` i32[W, chunk] (keys each slot sees; 0 for empty slots), ``count`` (live items),
      and per token ``item`` / ``slot`` i32[T] locating its output (``valid`` bool[T]).
    """
    max_num_seqs = kv_lens.shape[0]
    n = jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0]
    cu = cu_q_lens.astype(jnp.int32)
    live = (jnp.arange(max_num_seqs) < n) & select
    q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)
    chunks = (q_lens + chunk - 1) // chunk
    ends = jnp.cumsum(chunks)
    starts = ends - chunks
    width = max_items
    w = jnp.arange(width, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), max_num_seqs - 1).astype(jnp.int32)
    first = cu[seq] + (w - starts[seq]) * chunk
    offs = jnp.arange(chunk, dtype=jnp.int32)
    rows = first[:, None] + offs[None, :]
    ok = (w < ends[-1])[:, None] & (rows < cu[seq + 1][:, None])
    pos = kv_lens[seq][:, None].astype(jnp.int32) - cu[seq + 1][:, None] + rows  # causal position
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    t_seq, t_limit = reference.ragged_token_layout(num_tokens, kv_lens, cu_q_lens, num_seqs)
    t_item = starts[t_seq] + (t - cu[t_seq]) // chunk
    return {
        "seq": seq,
        "rows": jnp.clip(rows, 0, num_tokens - 1),
        "limit": jnp.where(ok, jnp.maximum(pos + 1, 0), 0),
        "count": ends[-1],
        "item": jnp.clip(t_item, 0, width - 1),
        "slot": (t - cu[t_seq]) % chunk,
        "valid": (t_limit > 0) & select[t_seq],
    }


def paged_attention(
    q, k_pages, v_pages, lengths, page_indices, *, sm_scale=1.0, soft_cap=None, config=None,
    layer=None, state=False, sliding_window=None, mass_weight=None,
):  # fmt: skip
    """``impl="xla"`` of :func:`pallas_kernels.paged_attention` (same arguments; with
    ``mass_weight`` f32[B] returns ``(out, mass f32[B, Hkv, pages_per_seq * page])``).

    ``state=True`` returns the unnormalised online-softmax state ``(m f32[B, Hq], l f32[B, Hq],
    acc f32[B, Hq, D])`` instead of the output (cascade attention merges states).
    """
    shp = validation.check_paged_attention(
        q, *validation.layer_view(k_pages, v_pages, layer), lengths, page_indices,
        sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    q, lengths, page_indices = map(jnp.asarray, (q, lengths, page_indices))
    k_pages, v_pages = quant.asarray(k_pages), quant.asarray(v_pages)
    qg = q.reshape(q.shape[0], shp.num_kv_heads, shp.group, shp.head_dim)
    extra = {}
    if mass_weight is not None:  # every query head of a row carries its token's weight
        w = jnp.asarray(mass_weight, jnp.float32)
        extra["mass_weight"] = jnp.broadcast_to(w[:, None], (q.shape[0], shp.group))
    out = grouped_rows_attention(
        qg, k_pages, v_pages, page_indices.astype(jnp.int32), lengths[:, None],
        jnp.int32(q.shape[0]), sm_scale=sm_scale, soft_cap=soft_cap, config=config or XlaConfig(),
        layer=layer, state=state, sliding_window=sliding_window, **extra,
    )  # fmt: skip
    if mass_weight is not None:
        out, mass = out
        return out.reshape(q.shape).astype(q.dtype), mass
    if state:
        m, lsum, acc = out
        return m.reshape(q.shape[:2]), lsum.reshape(q.shape[:2]), acc.reshape(q.shape)
    return out.reshape(q.shape).astype(q.dtype)


def ragged_paged_attention(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
    sm_scale=1.0, soft_cap=None, config=None, layer=None, sliding_window=None, mass_weight=None,
    kv_holes=None,
):  # fmt: skip
    """``impl="xla"`` of :func:`pallas_kernels.ragged_paged_attention` (same arguments; with
    ``mass_weight`` f32[T] returns ``(out, mass f32[max_num_seqs, Hkv, pages_per_seq * page])``,
    each sequence's items summed).

    Each sequence's query rows are cut into items of ``config.ragged_chunk`` consecutive tokens
    (one item per decode); an item gathers its sequence's pages once per KV block for all its
    tokens and heads, with a causal limit per query. A loop over groups of items stops after the
    last live one, so prefill chunks, decodes and verification share one code path without
    per-token copies of a prefill's KV.
    """
    shp = validation.check_ragged_paged_attention(
        q, *validation.layer_view(k_pages, v_pages, layer), kv_lens, page_indices, cu_q_lens,
        num_seqs, sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    q, kv_lens, page_indices, cu_q_lens = map(jnp.asarray, (q, kv_lens, page_indices, cu_q_lens))
    k_pages, v_pages = quant.asarray(k_pages), quant.asarray(v_pages)
    config = config or XlaConfig()
    num_tokens, max_num_seqs = q.shape[0], kv_lens.shape[0]
    cu = cu_q_lens.astype(jnp.int32)
    single = (cu[1:] - cu[:-1]) == 1
    # Two passes of work items: decodes one row per item (no wasted query slots), everything else
    # (prefill chunks, verification) in chunks of ragged_chunk rows sharing each KV gather.
    chunk = min(config.ragged_chunk, num_tokens)
    passes = (
        (single, 1, min(num_tokens, max_num_seqs)),
        (~single, chunk, min(-(-num_tokens // 2), max_num_seqs) + -(-num_tokens // chunk)),
    )
    out = jnp.zeros((num_tokens, shp.num_kv_heads, shp.group, shp.head_dim), jnp.float32)
    mass = None
    if mass_weight is not None:
        slots = page_indices.shape[1] * shp.page_size
        mass = jnp.zeros((max_num_seqs, shp.num_kv_heads, slots), jnp.float32)
    for select, size, max_items in passes:
        items = ragged_items(num_tokens, kv_lens, cu_q_lens, num_seqs, size, select, max_items)
        part = _ragged_pass(
            q, k_pages, v_pages, page_indices, items, shp, chunk=size, sm_scale=sm_scale,
            soft_cap=soft_cap, config=config, layer=layer, sliding_window=sliding_window,
            mass_weight=mass_weight, kv_holes=kv_holes,
        )  # fmt: skip
        if mass is not None:
            part, item_mass = part
            live = jnp.arange(item_mass.shape[0]) < items["count"]
            mass = mass.at[items["seq"]].add(jnp.where(live[:, None, None], item_mass, 0.0))
        out = jnp.where(items["valid"][:, None, None, None], part, out)
    out = out.reshape(q.shape).astype(q.dtype)
    return out if mass is None else (out, mass)


def _ragged_pass(q, k_pages, v_pages, page_indices, items, shp, *, chunk, sm_scale, soft_cap,
                 config, layer=None, sliding_window=None, mass_weight=None,
                 kv_holes=None):  # fmt: skip
    """Runs one pass of work items; returns f32[T, Hkv, G, D] (rows of other passes: garbage),
    and with ``mass_weight`` each item's mass f32[W, Hkv, S] (items past the count: 0)."""
    num_tokens, _, d = q.shape
    hkv, group = shp.num_kv_heads, shp.group
    width = items["seq"].shape[0]
    q_items = q.reshape(num_tokens, hkv, group, d)[items["rows"]]  # [W, chunk, Hkv, G, D]
    q_items = q_items.transpose(0, 2, 1, 3, 4).reshape(width, hkv, chunk * group, d)
    limit = jnp.repeat(items["limit"], group, axis=1)
    extra = {}
    if mass_weight is not None:  # empty slots see no key (limit 0): their weight never counts
        w = jnp.asarray(mass_weight, jnp.float32)[items["rows"]]  # [W, chunk]
        extra["mass_weight"] = jnp.repeat(w, group, axis=1)
    if kv_holes is not None:
        extra["hole"] = jnp.asarray(kv_holes, jnp.int32)[items["seq"]]
    out = grouped_rows_attention(
        q_items, k_pages, v_pages, page_indices.astype(jnp.int32)[items["seq"]], limit,
        items["count"], sm_scale=sm_scale, soft_cap=soft_cap, config=config, layer=layer,
        sliding_window=sliding_window, **extra,
    )  # fmt: skip
    mass = None
    if mass_weight is not None:
        out, mass = out
    out = out.reshape(width, hkv, chunk, group, d)[items["item"], :, items["slot"]]
    return out if mass is None else (out, mass)


def flash_attention(
    q, k, v, *, kv_lens=None, causal=True, sm_scale=1.0, soft_cap=None, config=None,
    kv_head_major=False,
):  # fmt: skip
    """``impl="xla"`` of :func:`pallas_kernels.flash_attention` (same arguments).

    ``kv_head_major=True`` takes ``k``/``v`` as ``[B, Hkv, Tk, D]``: each head's keys are then
    contiguous, so a block needs no transpose (in ``[B, Tk, Hkv, D]`` one head's keys are rows
    ``Hkv * D`` apart). Not part of the public op; the kernel benchmark's second dense baseline.
    """
    config = config or XlaConfig()
    k_view, v_view = k, v
    if kv_head_major:  # validate the [B, Tk, Hkv, D] view
        k_view, v_view = (
            jax.ShapeDtypeStruct((*x.shape[:1], *x.shape[1:3][::-1], *x.shape[3:]), x.dtype)
            for x in map(jnp.asarray, (k, v))
        )
    batch, q_len, kv_len, hq, hkv, d = validation.check_flash_attention(
        q, k_view, v_view, kv_lens, causal=causal, sm_scale=sm_scale, soft_cap=soft_cap
    )
    group = hq // hkv
    q, k, v = map(jnp.asarray, (q, k, v))
    if kv_lens is None:
        kv_lens = jnp.full((batch,), kv_len, jnp.int32)
    kv_lens = jnp.minimum(jnp.asarray(kv_lens).astype(jnp.int32), kv_len)
    # Batch groups of items_per_group keep one group's key block in cache; the last group (and
    # the last key block) slide back to stay in bounds: rows / keys computed twice are identical
    # (rows) or masked (keys, pos < lo).
    bg = min(config.items_per_group, batch)
    block = min(kv_len, config.block_tokens)
    block = max(1, min(block, config.max_score_elements // max(1, bg * hq * q_len)))
    num_blocks = -(-kv_len // block)
    if causal:
        limit = kv_lens[:, None] - q_len + 1 + jnp.arange(q_len, dtype=jnp.int32)[None, :]
        limit = jnp.clip(limit, 0, kv_lens[:, None])  # [B, Tq]
    else:
        limit = jnp.broadcast_to(kv_lens[:, None], (batch, q_len))
    qf = q.reshape(batch, q_len, hkv, group, d).astype(jnp.float32).transpose(0, 2, 1, 3, 4)
    qf = qf.reshape(batch, hkv, q_len * group, d)

    def group_body(g, out):
        b0 = jnp.minimum(g * bg, batch - bg)
        lens = lax.dynamic_slice_in_dim(kv_lens, b0, bg)
        lim = lax.dynamic_slice_in_dim(limit, b0, bg)  # [bg, Tq]
        lim = jnp.repeat(lim, group, axis=1)[:, None, :, None]  # [bg, 1, Tq * G, 1]
        qg = lax.dynamic_slice_in_dim(qf, b0, bg)  # [bg, Hkv, Tq * G, D]

        def body(i, carry):
            lo = i * block
            start = jnp.minimum(lo, kv_len - block)

            def load(x):  # -> f32[bg, Hkv, block, D], the layout the dots want
                x = _in_loop(x, b0, start)
                if kv_head_major:
                    return lax.dynamic_slice(x, (b0, 0, start, 0), (bg, hkv, block, d)).astype(
                        jnp.float32
                    )
                x = lax.dynamic_slice(x, (b0, start, 0, 0), (bg, block, hkv, d))
                return jnp.swapaxes(x, 1, 2).astype(jnp.float32)

            pos = start + jnp.arange(block, dtype=jnp.int32)  # [block]
            valid = (pos >= lo) & (pos < lim)  # [bg, 1, Tq * G, block]
            s = jnp.einsum("bhmd,bhkd->bhmk", qg, load(k))
            s = softmax.scale_scores(s, sm_scale=sm_scale, soft_cap=soft_cap)
            v_valid = (pos >= lo)[None, :] & (pos[None, :] < lens[:, None])  # [bg, block]
            vb = jnp.where(v_valid[:, None, :, None], load(v), 0.0)
            return softmax.online_softmax_step(carry, s, vb, valid)

        init = softmax.initial_state((bg, hkv, q_len * group), d)
        trips = jnp.minimum((jnp.max(lens) + block - 1) // block, num_blocks)
        _, lsum, acc = lax.fori_loop(0, trips, body, init)
        return lax.dynamic_update_slice_in_dim(out, softmax.normalize(lsum, acc), b0, axis=0)

    out = jnp.zeros((batch, hkv, q_len * group, d), jnp.float32)
    out = lax.fori_loop(0, -(-batch // bg), group_body, out)
    out = out.reshape(batch, hkv, q_len, group, d)  # [B, Hkv, Tq, G, D]
    return out.transpose(0, 2, 1, 3, 4).reshape(q.shape).astype(q.dtype)
