"""Sliding-window attention in every implementation vs float64 numpy.

Windows smaller than, equal to and larger than a page (page 8: W = 5, 8, 13) and one longer than
every sequence (the full causal result). The table entries of pages wholly behind every query's
window are pointed at the null page and their old pages filled with NaN, as after block
recycling: a kernel that used them would return NaN or a wrong value.
"""

import jax
import numpy as np
import pytest
from tolerances import tol

import pallas_kernels as pk
from pallas_kernels import compat, testing
from pallas_kernels.gpu_common import GpuPagedConfig
from pallas_kernels.tpu_common import TpuPagedConfig

PAGE, PPS, D = 8, 4, 64
IMPLS = {
    "reference": None,
    "xla": pk.XlaConfig(block_tokens=8),
    "interpret_tpu": TpuPagedConfig(pages_per_compute_block=2, queries_per_block=8),
    "interpret_gpu": GpuPagedConfig(pages_per_compute_block=2, queries_per_block=4),
}
WINDOWS = (5, 8, 13, 1000)
# (impl, window): every implementation with windows below, at and above a page; the window longer
# than every sequence (the full causal result) only where it is cheap.
CASES = [(impl, w) for impl in IMPLS for w in WINDOWS
         if w != 1000 or not impl.startswith("interpret")]


def _recycle(case, first_pos, window):
    """Points every page wholly behind ``first_pos - window + 1`` at the null page (NaN) and
    fills the page it pointed at with NaN; returns the new (k_pages, v_pages, page_indices)."""
    k, v, table = case.k_pages.copy(), case.v_pages.copy(), case.page_indices.copy()
    for s, pos in enumerate(first_pos):
        behind = max(pos + 1 - window, 0) // PAGE
        for j in range(behind):
            k[:, table[s, j]] = np.nan
            v[:, table[s, j]] = np.nan
            table[s, j] = testing.NULL_PAGE
    return k, v, table


@pytest.mark.parametrize("impl,window", CASES)
def test_decode_window(impl, window):
    rng = np.random.default_rng(window)
    lengths = [1, 5, 8, 9, 17, 24, 32]
    case = testing.make_paged_case(rng, lengths, num_kv_heads=2, head_dim=D, page_size=PAGE,
                                   pages_per_seq=PPS)
    k, v, table = _recycle(case, [n - 1 for n in lengths], window)
    q = testing.random_q(rng, (len(lengths), 4, D))
    kw = dict(sm_scale=D**-0.5, sliding_window=window)
    out = pk.paged_attention(q, k, v, case.lengths, table, **kw, impl=impl, config=IMPLS[impl])
    assert not compat.races_found()
    want = testing.paged_attention_np(q, case.k_pages, case.v_pages, case.lengths,
                                      case.page_indices, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol("float32"))


@pytest.mark.parametrize("impl,window", CASES)
def test_ragged_window(impl, window):
    rng = np.random.default_rng(window + 1)
    seqs = testing.mixed_batch(PAGE, PPS)
    q, case, cu, n = testing.make_ragged_case(
        rng, seqs, num_q_heads=4, num_kv_heads=2, head_dim=D, page_size=PAGE, pages_per_seq=PPS)
    first = [kv - ql for kv, ql in seqs] + [0]  # first query position (idle slot: keep pages)
    k, v, table = _recycle(case, first, window)
    args = (case.lengths, table, cu, n)
    kw = dict(sm_scale=D**-0.5, sliding_window=window)
    fn = lambda *a: pk.ragged_paged_attention(*a, **kw, impl=impl, config=IMPLS[impl])  # noqa: E731
    out = jax.jit(fn)(q, k, v, *args) if impl == "xla" else fn(q, k, v, *args)
    assert not compat.races_found()
    want = testing.ragged_paged_attention_np(q, case.k_pages, case.v_pages, case.lengths,
                                             case.page_indices, cu, n, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol("float32"))
    assert not np.any(np.asarray(out)[cu[-1]:]), "padding rows must be zeros"


def test_reference_hand_case():
    """One query at position 3 with W = 2 sees keys 2 and 3 only: equal scores average them."""
    k = np.zeros((1, 2, 4, 2), np.float32)  # [Hkv, P, page, D]; page 0 null
    v = np.zeros((1, 2, 4, 2), np.float32)
    v[0, 1, :, 0] = [100.0, 10.0, 2.0, 4.0]
    out = pk.paged_attention(np.ones((1, 1, 2), np.float32), k, v, np.array([4], np.int32),
                             np.array([[1]], np.int32), sliding_window=2, impl="reference")
    np.testing.assert_allclose(np.asarray(out)[0, 0], [3.0, 0.0])


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_window(bad):
    case = testing.make_paged_case(np.random.default_rng(0), [3], num_kv_heads=1, head_dim=D,
                                   page_size=PAGE, pages_per_seq=1)
    with pytest.raises((ValueError, TypeError), match="sliding_window"):
        pk.paged_attention(np.zeros((1, 1, D), np.float32), case.k_pages, case.v_pages,
                           case.lengths, case.page_indices, sliding_window=bad, impl="xla")
