"""Cascade (shared-prefix) decode attention vs float64 numpy and vs ordinary paged attention.

Cases mix groups of different sizes (2-5 members) sharing 1-4 prefix pages, suffixes of 0-3
pages with partial last pages, sequences in no group, and padded group slots / padded groups; the
pool's unused pages, the null page and slots past each length hold NaN, so a pass that reads a
key it must not (a prefix page in the suffix pass, a slot past a length) turns the output NaN.
"""

import jax
import numpy as np
import pytest
from tolerances import tol

import pallas_kernels as pk
from pallas_kernels import cascade, reference, testing
from pallas_kernels.gpu_common import GpuPagedConfig
from pallas_kernels.tpu_common import TpuPagedConfig

IMPLS = ("reference", "xla", "interpret_tpu", "interpret_gpu")
CONFIGS = {
    "interpret_tpu": TpuPagedConfig(pages_per_compute_block=2),
    "interpret_gpu": GpuPagedConfig(pages_per_compute_block=2, k_splits=2),
}


def _groups(page):
    # (prefix pages, suffix lengths): a suffix of 0, partial pages, exactly a page, 3 pages.
    return [(2, [3, page, 0]), (1, [2 * page + 1, 5]), (4, [1, 3 * page, page - 1, 7, 2])]


def _case(seed, *, hq, hkv, page, d=64, dtype="float32", groups=None, pps=7):
    rng = np.random.default_rng(seed)
    return testing.make_cascade_case(
        rng, groups if groups is not None else _groups(page), [page + 3, 1, 2 * page],
        num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page, pages_per_seq=pps,
        num_groups=4, group_size=6, dtype=dtype,
    )  # fmt: skip


def _run(case, impl, *, jit=False, **kw):
    fn = lambda *a: pk.cascade_paged_attention(*a, impl=impl, config=CONFIGS.get(impl), **kw)  # noqa: E731
    args = (case.q, case.k_pages, case.v_pages, case.lengths, case.page_indices, case.group_rows,
            case.prefix_lens)  # fmt: skip
    return (jax.jit(fn) if jit else fn)(*args)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv,page", [(4, 2, 8), (2, 2, 16)])  # GQA, MHA
def test_cascade_matches_float64_and_ordinary(impl, hq, hkv, page):
    case = _case(page + hq, hq=hq, hkv=hkv, page=page)
    kw = dict(sm_scale=64**-0.5)
    out = _run(case, impl, jit=impl == "xla", **kw)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    args = (case.q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    want = testing.paged_attention_np(*args, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol("float32"))
    ordinary = pk.paged_attention(*args, **kw, impl=impl, config=CONFIGS.get(impl))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ordinary), **tol("float32"))


def test_cascade_bfloat16_soft_cap_xla():
    case = _case(3, hq=4, hkv=1, page=16, dtype="bfloat16")
    kw = dict(sm_scale=0.125, soft_cap=20.0)
    out = _run(case, "xla", **kw)
    args = (case.q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               testing.paged_attention_np(*args, **kw), **tol("bfloat16"))


def test_no_groups_and_stacked_layer():
    """All groups padding: cascade is ordinary attention; ``layer=`` reads the stacked cache."""
    case = _case(5, hq=4, hkv=2, page=8)
    rows, prefix = np.full_like(case.group_rows, -1), np.zeros_like(case.prefix_lens)
    stacked_k = np.stack([np.full_like(case.k_pages, np.nan), case.k_pages])
    stacked_v = np.stack([np.full_like(case.v_pages, np.nan), case.v_pages])
    args = (case.q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    want = testing.paged_attention_np(*args)
    out = pk.cascade_paged_attention(*args, rows, prefix, impl="xla")
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol("float32"))
    for impl in ("xla", "reference"):
        out = pk.cascade_paged_attention(case.q, stacked_k, stacked_v, case.lengths,
                                         case.page_indices, case.group_rows, case.prefix_lens,
                                         impl=impl, layer=1)  # fmt: skip
        np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol("float32"))


def test_prefix_not_multiple_of_page_is_rounded_down():
    """A prefix length inside a page shares only the whole pages before it (rest: suffix)."""
    case = _case(6, hq=2, hkv=1, page=8)
    out = pk.cascade_paged_attention(case.q, case.k_pages, case.v_pages, case.lengths,
                                     case.page_indices, case.group_rows, case.prefix_lens + 5,
                                     impl="reference")  # fmt: skip
    args = (case.q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    np.testing.assert_allclose(np.asarray(out, np.float64), testing.paged_attention_np(*args),
                               **tol("float32"))


def test_state_reference_hand_computed():
    """One head, two keys: m, l and acc of the state by hand."""
    q = np.array([[[1.0, 0.0]]], np.float32)  # [1, 1, 2]
    k = np.zeros((1, 2, 2, 2), np.float32)
    v = np.zeros((1, 2, 2, 2), np.float32)
    k[0, 1, 0], k[0, 1, 1] = [2.0, 0.0], [0.0, 5.0]  # scores 2 and 0
    v[0, 1, 0], v[0, 1, 1] = [1.0, 2.0], [3.0, 4.0]
    m, lsum, acc = reference.paged_attention_state(q, k, v, np.array([2]), np.array([[1]]))
    e = np.exp(-2.0)
    np.testing.assert_allclose(np.asarray(m), [[2.0]])
    np.testing.assert_allclose(np.asarray(lsum), [[1.0 + e]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(acc), [[[1.0 + 3 * e, 2.0 + 4 * e]]], rtol=1e-6)


def test_kv_bytes_read_formula():
    # Page 16, 8 bytes per token: lengths 40, 40, 20 (3, 3, 2 pages); a group of the first two
    # sharing 32 tokens (2 pages) saves 2 pages = 256 bytes.
    got = cascade.kv_bytes_read([40, 40, 20], [[0, 1]], [32], page_size=16, bytes_per_token=8)
    assert got == {"ordinary": 8 * 128, "cascade": 6 * 128, "saved": 2 * 128}


@pytest.mark.parametrize("bad,match", [
    (dict(group_rows=np.zeros((0, 2), np.int32)), "num_groups >= 1"),
    (dict(prefix_lens=np.zeros(3, np.int32)), "prefix_lens.shape"),
    (dict(group_rows=np.zeros((4, 6), np.float32)), "integer"),
])  # fmt: skip
def test_bad_group_arguments(bad, match):
    case = _case(7, hq=2, hkv=1, page=8)
    kw = dict(group_rows=case.group_rows, prefix_lens=case.prefix_lens) | bad
    with pytest.raises((ValueError, TypeError), match=match):
        pk.cascade_paged_attention(case.q, case.k_pages, case.v_pages, case.lengths,
                                   case.page_indices, kw["group_rows"], kw["prefix_lens"])


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "interpret_gpu", "interpret_tpu"])
def test_cascade_random_groups_long_prefixes(impl):
    """Random groups, prefixes of 1-64 pages, suffixes of 0-3 pages (partial last pages)."""
    rng = np.random.default_rng(11)
    page = 8
    groups = [(int(p), [int(s) for s in rng.integers(0, 3 * page + 1, size=int(n))])
              for p, n in zip([1, 64, 17, 5], rng.integers(2, 6, size=4))]  # fmt: skip
    case = _case(12, hq=4, hkv=2, page=page, groups=groups, pps=68)
    out = _run(case, impl, sm_scale=0.125)
    args = (case.q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               testing.paged_attention_np(*args, sm_scale=0.125), **tol("float32"))
