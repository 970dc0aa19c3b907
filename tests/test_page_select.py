"""Quest page selection (pallas_kernels.page_select) and the page key bounds of the KV cache.

Selection against a hand-computed case; bounds maintained by the write (a reused page restarts)
and moved by every page copy; the selected-page decode against float64 numpy on the same
selection with every unselected page NaN-poisoned (a kernel that reads one spoils its output);
identical to dense decode when the budget covers every page.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jit_utils import jit_call
from tolerances import tol

import pallas_kernels as pk
from paged.kv import cache as kc
from pallas_kernels import page_select, testing


def _bounds_np(k_pages, lengths, page_indices, page):
    """[Hkv, P, 2, D] bounds of the valid keys of each sequence's pages (others +-inf)."""
    k = np.asarray(k_pages, np.float32)
    out = np.stack([np.full(k.shape[:2] + k.shape[3:], np.inf, np.float32),
                    np.full(k.shape[:2] + k.shape[3:], -np.inf, np.float32)], axis=2)
    for n, row in zip(lengths, page_indices):
        for j in range(-(-int(n) // page)):
            fill = min(page, int(n) - j * page)
            keys = k[:, row[j], :fill]  # [Hkv, fill, D]
            out[:, row[j], 0], out[:, row[j], 1] = keys.min(1), keys.max(1)
    return out


def test_selection_matches_a_hand_computed_case():
    # One sequence, one KV head, two query heads (GQA max), D = 2, pages of 2, 5 logical pages.
    bounds = np.zeros((1, 8, 2, 2), np.float32)
    bounds[0, 3] = [[0, 0], [1, 1]]       # logical 1: q0 -> 1 + 0 = 1; q1 -> 0 + 0 = 0
    bounds[0, 5] = [[-2, -3], [2, -1]]    # logical 2: q0 -> 2 + 3 = 5; q1 -> 2 + 0 = 2
    bounds[0, 1] = [[0, 0], [0.5, 0.5]]   # logical 3: q0 -> 0.5 + 0 = 0.5; q1 -> 0 + 0 = 0
    table = np.array([[7, 3, 5, 1, 6, 0]], np.int32)  # logical -> physical, NULL padded
    q = np.array([[[[1.0, -1.0], [-1.0, 0.0]]]], np.float32)  # [S=1, Hkv=1, G=2, D=2]
    scores = np.asarray(page_select.page_scores(q, bounds, table))
    np.testing.assert_allclose(scores[0, 0, 1:4], [1.0, 5.0, 0.5])
    kv = np.array([9])  # the last page holds 1 token
    # 0.5 of 5 pages: max(2, ceil(2.5)) = 3 pages.
    for budget, want in ((3, [7, 5, 6]), (4, [7, 3, 5, 6]), (5, [7, 3, 5, 1, 6]), (2, [7, 6]),
                         (0.5, [7, 5, 6])):
        t, n = page_select.select_pages_jit(q, bounds, kv, table, np.array([True]), page_size=2,
                                            budget=budget)
        c = len(want)
        assert np.asarray(t)[0, 0, :c].tolist() == want, budget
        assert np.all(np.asarray(t)[0, 0, c:] == 0)
        assert int(n[0, 0]) == (c - 1) * 2 + 1  # full pages, then the open page's one token
    t, n = page_select.select_pages_jit(q, bounds, kv, table, np.array([False]), page_size=2,
                                        budget=3)
    assert int(n[0, 0]) == 0


def test_gqa_modes_on_a_hand_computed_case():
    # One KV head, two query heads of different scale: head 0 scores the middle pages A, B, C
    # 10, 9, 0; head 1 scores them 0, 0, 1. "max" follows head 0 (A, B); "rank" takes each
    # head's best in turn (A, then C); "union" takes every head's own top pages.
    bounds = np.zeros((1, 8, 2, 2), np.float32)
    bounds[0, 3] = [[10, 0], [10, 0]]  # logical 1 (A)
    bounds[0, 5] = [[9, 0], [9, 0]]    # logical 2 (B)
    bounds[0, 1] = [[0, 1], [0, 1]]    # logical 3 (C)
    table = np.array([[7, 3, 5, 1, 6, 0]], np.int32)
    q = np.array([[[[1.0, 0.0], [0.0, 1.0]]]], np.float32)  # [S=1, Hkv=1, G=2, D=2]
    kv = np.array([9])
    for gqa, budget, want in (("max", 4, [7, 3, 5, 6]), ("rank", 4, [7, 3, 1, 6]),
                              ("rank", 3, [7, 3, 6]), ("union", 3, [7, 3, 1, 6]),
                              ("union", 4, [7, 3, 5, 1, 6]), ("union", 2, [7, 6])):
        t, n = page_select.select_pages_jit(q, bounds, kv, table, np.array([True]), page_size=2,
                                            budget=budget, gqa=gqa)
        c = len(want)
        assert np.asarray(t)[0, 0, :c].tolist() == want, (gqa, budget)
        assert np.all(np.asarray(t)[0, 0, c:] == 0)
        assert int(n[0, 0]) == (c - 1) * 2 + 1, (gqa, budget)
    with pytest.raises(ValueError, match="gqa"):
        page_select.select_pages(q, bounds, kv, table, np.array([True]), page_size=2, budget=3,
                                 gqa="mean")


def test_recent_pages_are_kept_inside_the_budget():
    # One KV head, one query head, 6 logical pages (physical 7 3 5 1 6 0; 11 keys at page 2):
    # scores 10, 9, 0, 1 for logical 1-4. Budget 4 keeps the sink, the open page and the top 2
    # (1, 2); one recent page forces logical 4 in and leaves one slot (logical 1); two recent
    # pages force 3 and 4; a window larger than the budget is cut to budget - 2 (the nearest).
    bounds = np.zeros((1, 8, 2, 2), np.float32)
    for phys, score in ((3, 10), (5, 9), (1, 0), (6, 1)):
        bounds[0, phys] = [[score, 0], [score, 0]]
    table = np.array([[7, 3, 5, 1, 6, 0]], np.int32)
    q = np.array([[[[1.0, 0.0]]]], np.float32)  # [S=1, Hkv=1, G=1, D=2]
    kv = np.array([11])
    for gqa, budget, recent, want in (
            ("max", 4, 0, [7, 3, 5, 0]), ("max", 4, 1, [7, 3, 6, 0]),
            ("max", 4, 2, [7, 1, 6, 0]), ("max", 4, 9, [7, 1, 6, 0]),
            ("max", 3, 1, [7, 6, 0]), ("max", 2, 3, [7, 0]), ("rank", 4, 1, [7, 3, 6, 0]),
            ("union", 4, 1, [7, 3, 6, 0]), ("max", 0.6, 1, [7, 3, 6, 0]),
            ("max", 6, 2, [7, 3, 5, 1, 6, 0])):
        t, n = page_select.select_pages_jit(q, bounds, kv, table, np.array([True]), page_size=2,
                                            budget=budget, gqa=gqa, recent=recent)
        c = len(want)
        assert np.asarray(t)[0, 0, :c].tolist() == want, (gqa, budget, recent)
        assert int(n[0, 0]) == (c - 1) * 2 + 1, (gqa, budget, recent)
        # the no-cache reference keeps the same pages for the same query and keys
        keys = np.zeros((1, 11, 1, 2), np.float32)
        for logical, phys in enumerate(table[0]):
            keys[0, 2 * logical:2 * logical + 2, 0] = bounds[0, phys, 0] if phys else 0
        m = jit_call(page_select.dense_selection_mask, q.reshape(1, 1, 1, 2), keys, page_size=2,
                     budget=budget, gqa=gqa, recent=recent)
        pages = np.asarray(m)[0, 0, 0].reshape(-1)[::2][:6]
        assert [int(table[0, p]) for p in np.flatnonzero(pages)] == want, (gqa, budget, recent)


def test_update_bounds_follows_the_writes_and_restarts_a_reused_page():
    rng = np.random.default_rng(0)
    cache = kc.KVCache.create(2, 2, 6, 4, 8, page_bounds=True)
    written: dict[int, list] = {}

    def write(slots):
        nonlocal cache
        k = rng.standard_normal((2, len(slots), 2, 8)).astype(np.float32)
        cache = kc.write(cache, jnp.asarray(k), jnp.asarray(k), np.asarray(slots, np.int32))
        for i, s in enumerate(slots):
            page, off = divmod(s, 4)
            if off == 0:
                written[page] = []
            written[page].append(k[:, i])  # [L, Hkv, D]

    write([8, 9, 10, 20])    # page 2 offsets 0-2, page 5 offset 0
    write([11, 12, 21])      # page 2 fills, page 3 opens, page 5 grows
    write([20, 21, 22])      # page 5 reused from offset 0: its old keys no longer count
    bounds = np.asarray(cache.key_bounds)
    for page, keys in written.items():
        keys = np.stack(keys, axis=2)  # [L, Hkv, n, D]
        np.testing.assert_array_equal(bounds[:, :, page, 0], keys.min(2))
        np.testing.assert_array_equal(bounds[:, :, page, 1], keys.max(2))


def test_bounds_move_with_their_pages():
    rng = np.random.default_rng(1)
    cache = kc.KVCache.create(1, 2, 8, 4, 8, page_bounds=True)
    k = rng.standard_normal((1, 12, 2, 8)).astype(np.float32)
    cache = kc.write(cache, jnp.asarray(k), jnp.asarray(k), np.arange(4, 16, dtype=np.int32))
    before = np.asarray(cache.key_bounds)
    cache = kc.copy_pages(cache, [1, 2], [5, 6])  # copy-on-write
    np.testing.assert_array_equal(np.asarray(cache.key_bounds)[:, :, [5, 6]], before[:, :, [1, 2]])
    host_k, host_v = kc.host_buffers(cache, 4)  # swap space (and the host tier's slots)
    hk, hv = kc.swap_out(cache, [3])
    kc.host_set(host_k, [2], hk)
    kc.host_set(host_v, [2], hv)
    cache = kc.poison(cache, [3])
    assert np.isnan(np.asarray(cache.key_bounds)[:, :, 3]).all()
    cache = kc.swap_in(cache, [7], kc.host_get(host_k, [2]), kc.host_get(host_v, [2]))
    np.testing.assert_array_equal(np.asarray(cache.key_bounds)[:, :, 7], before[:, :, 3])
    gk, gv = kc.gather_pages(cache, [7])  # hand-over between replicas
    other = kc.scatter_pages(kc.KVCache.create(1, 2, 8, 4, 8, page_bounds=True), [4], gk, gv)
    np.testing.assert_array_equal(np.asarray(other.key_bounds)[:, :, 4], before[:, :, 3])
    assert cache.metadata_nbytes == 1 * 2 * 8 * 2 * 8 * 4
    assert cache.nbytes == 2 * 1 * 2 * 8 * 4 * 8 * 4 + cache.metadata_nbytes


def _selected_case(seed, *, hq, hkv, page, budget, dtype="float32", gqa="max", recent=0):
    rng = np.random.default_rng(seed)
    lengths = [0, 1, page + 1, 3 * page, 7 * page - 1, 8 * page]
    case = testing.make_paged_case(rng, lengths, num_kv_heads=hkv, head_dim=64, page_size=page,
                                   pages_per_seq=8, dtype=dtype)
    bounds = _bounds_np(case.k_pages, case.lengths, case.page_indices, page)
    q = testing.random_q(rng, (len(lengths), hq, 64), dtype)
    active = case.lengths > 0
    qs = np.asarray(q, np.float32).reshape(len(lengths), hkv, hq // hkv, 64)
    table, sel = page_select.select_pages_jit(qs, bounds, case.lengths, case.page_indices, active,
                                              page_size=page, budget=budget, gqa=gqa,
                                              recent=recent)
    return q, case, bounds, active, np.asarray(table), np.asarray(sel)


@pytest.mark.parametrize("impl", ["xla", "interpret_gpu", "interpret_tpu"])
@pytest.mark.parametrize("op, hq, hkv, page, gqa", [
    ("paged", 4, 2, 8, "max"), ("paged", 2, 2, 16, "max"),  # the decode kernels: GQA, MHA
    ("ragged", 4, 2, 16, "max"), ("ragged", 2, 2, 8, "max"),  # the ragged kernels
    ("paged", 6, 2, 8, "union"),  # per-KV-head lengths: union lists differ in size
])
def test_selected_pages_against_float64_with_the_rest_poisoned(impl, op, hq, hkv, page, gqa):
    q, case, bounds, active, table, sel = _selected_case(page + hq, hq=hq, hkv=hkv, page=page,
                                                         budget=3, gqa=gqa)
    k_pages, v_pages = np.array(case.k_pages), np.array(case.v_pages)
    for h in range(hkv):  # NaN in every page the selection does not read, per KV head
        keep = set(table[:, h].ravel().tolist())
        drop = [p for p in range(1, k_pages.shape[1]) if p not in keep]
        k_pages[h, drop] = np.nan
        v_pages[h, drop] = np.nan
    assert (sel[active] < case.lengths[active, None]).any()  # the budget drops pages
    out = jit_call(
        page_select.sparse_paged_attention, q, k_pages, v_pages, bounds, case.lengths,
        case.page_indices, active, budget=3, sm_scale=0.125, impl=impl, op=op, gqa=gqa)
    qf, ft, fl = jit_call(page_select.flatten_selection, q, table, sel,
                          num_pages=k_pages.shape[1])
    flat = lambda x: np.asarray(jit_call(page_select.heads_as_pages, x))  # noqa: E731
    want = testing.paged_attention_np(qf, flat(k_pages), flat(v_pages), fl, ft, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float64), want.reshape(q.shape),
                               **tol("float32"))


@pytest.mark.parametrize("budget, gqa, recent", [(8, "max", 0), (1.0, "max", 0), (8, "rank", 0),
                                                 (1.0, "union", 0), (1.0, "max", 3)])
def test_covering_budget_is_dense_decode(budget, gqa, recent):
    q, case, bounds, active, table, sel = _selected_case(3, hq=4, hkv=2, page=8, budget=budget,
                                                         gqa=gqa, recent=recent)
    np.testing.assert_array_equal(sel, np.broadcast_to(case.lengths[:, None], sel.shape))
    out = jit_call(
        page_select.sparse_paged_attention, q, case.k_pages, case.v_pages, bounds, case.lengths,
        case.page_indices, active, budget=budget, sm_scale=0.125, impl="xla", gqa=gqa,
        recent=recent)
    dense = jit_call(pk.paged_attention, q, case.k_pages, case.v_pages, case.lengths,
                     case.page_indices, sm_scale=0.125, impl="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl, granularity", [("xla", "token"), ("interpret_gpu", "page")])
def test_quantized_pages_bounds_and_selected_decode(impl, granularity):
    """int8 pages: the write path's bounds are the min / max of the dequantized keys (what the
    kernels read), and the selected-page decode over a quantized pool matches float64 on the
    dequantized pages, with the scales of every unselected page NaN (a read spoils the output)."""
    from pallas_kernels import quant

    q, case, _, active, _, _ = _selected_case(5, hq=4, hkv=2, page=8, budget=3)
    x = np.nan_to_num(np.asarray(case.k_pages))
    pool = jit_call(quant.quantize_pool, x, dtype=jnp.int8, granularity=granularity)
    deq = np.asarray(jit_call(quant.dequantize, pool))
    slots = np.concatenate([row[j // 8] * 8 + j % 8 + np.zeros(1, np.int32)
                            for n, row in zip(case.lengths, case.page_indices) for j in range(n)])
    empty = page_select.init_bounds((1, 2, pool.shape[1], 2, 64), jnp.float32)
    layered = quant.QuantizedPages(pool.values[None], pool.scales[None])
    got = np.asarray(jit_call(page_select.update_bounds, empty, layered, slots))[0]
    want = _bounds_np(deq, case.lengths, case.page_indices, 8)
    used = np.isfinite(want[:, :, 0, 0])
    np.testing.assert_array_equal(got[used], want[used])
    v = jit_call(quant.quantize_pool, np.nan_to_num(np.asarray(case.v_pages)), dtype=jnp.int8,
                 granularity=granularity)
    qs = np.asarray(q, np.float32).reshape(len(case.lengths), 2, 2, 64)
    table, sel = page_select.select_pages_jit(qs, got, case.lengths, case.page_indices, active,
                                              page_size=8, budget=3)
    table, sel = np.asarray(table), np.asarray(sel)
    assert (sel[active] < case.lengths[active, None]).any()  # the budget drops pages
    k_scales, v_scales = np.array(pool.scales), np.array(v.scales)
    for h in range(2):
        drop = [p for p in range(1, pool.shape[1]) if p not in set(table[:, h].ravel().tolist())]
        k_scales[h, drop] = np.nan
        v_scales[h, drop] = np.nan
    out = jit_call(
        page_select.sparse_paged_attention, q,
        quant.QuantizedPages(pool.values, jnp.asarray(k_scales)),
        quant.QuantizedPages(v.values, jnp.asarray(v_scales)), got, case.lengths,
        case.page_indices, active, budget=3, sm_scale=0.125, impl=impl)
    qf, ft, fl = jit_call(page_select.flatten_selection, q, table, sel, num_pages=pool.shape[1])
    flat = lambda x: np.asarray(jit_call(page_select.heads_as_pages, x))  # noqa: E731
    want_out = testing.paged_attention_np(
        qf, flat(deq), flat(np.asarray(jit_call(quant.dequantize, v))), fl, ft, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out.reshape(q.shape),
                               **tol("float32"))


@pytest.mark.parametrize("gqa", ["max", "rank", "union"])
def test_reference_mask_of_the_last_queries_is_the_full_masks_tail(gqa):
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((1, 40, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 40, 2, 8)), jnp.float32)
    full = jit_call(page_select.dense_selection_mask, q, k, page_size=4, budget=0.25, gqa=gqa)
    tail = jit_call(page_select.dense_selection_mask, q[:, 33:], k, page_size=4, budget=0.25,
                    gqa=gqa)
    np.testing.assert_array_equal(np.asarray(tail), np.asarray(full)[:, :, 33:])
    assert not np.asarray(tail)[0, :, -1].all()  # the budget drops keys
