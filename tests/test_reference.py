"""The float32 references (and the "xla" path) against hand-computed cases and float64 numpy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jit_utils import jit_call
from tolerances import tol

import pallas_kernels as pk
from pallas_kernels import reference, testing

NAN = np.nan


def _hand_pages():
    """Two keys of one KV head, D=2, page size 2, in page 2 of a NaN pool; page 1 and slot 2 unused.

    With q = [1, 0], k0 = [1, 0], k1 = [0, 0] and sm_scale = ln 3 the scores are ln 3 and 0, so
    p = [3/4, 1/4]; with v0 = [1, 0], v1 = [0, 2] the output is [3/4, 1/2].
    """
    k = np.full((1, 3, 2, 2), NAN, np.float32)
    v = np.full((1, 3, 2, 2), NAN, np.float32)
    k[0, 2, 0], k[0, 2, 1] = [1, 0], [0, 0]
    v[0, 2, 0], v[0, 2, 1] = [1, 0], [0, 2]
    return jnp.asarray(k), jnp.asarray(v)


LN3 = math.log(3.0)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_paged_attention_hand_case(impl):
    k, v = _hand_pages()
    q = jnp.asarray([[[1.0, 0.0]], [[1.0, 0.0]], [[5.0, 5.0]]])  # [B=3, Hq=1, D=2]
    lengths = jnp.asarray([2, 1, 0], jnp.int32)
    table = jnp.asarray([[2, 0], [2, 1], [1, 1]], jnp.int32)  # entries past a length point at NaN
    out = jit_call(pk.paged_attention, q, k, v, lengths, table, sm_scale=LN3, impl=impl)
    want = np.asarray([[[0.75, 0.5]], [[1.0, 0.0]], [[0.0, 0.0]]])
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_paged_attention_hand_soft_cap(impl):
    k, v = _hand_pages()
    q = jnp.asarray([[[1.0, 0.0]]])
    out = jit_call(
        pk.paged_attention, q, k, v, jnp.asarray([2]), jnp.asarray([[2, 0]]), sm_scale=LN3,
        soft_cap=0.5, impl=impl,
    )  # fmt: skip
    s0 = 0.5 * math.tanh(LN3 / 0.5)  # capped logit of k0; k1's is tanh(0) = 0
    p0 = math.exp(s0) / (math.exp(s0) + 1.0)
    np.testing.assert_allclose(np.asarray(out)[0, 0], [p0, 2 * (1 - p0)], atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_ragged_hand_case(impl):
    """Sequence 0 verifies 2 tokens (positions 0 and 1); slot 1 is empty; row 2 is padding."""
    k, v = _hand_pages()
    q = jnp.asarray([[[1.0, 0.0]], [[1.0, 0.0]], [[7.0, 7.0]]])  # [T=3, Hq=1, D=2]
    out = jit_call(
        pk.ragged_paged_attention, q, k, v,
        jnp.asarray([2, 0], jnp.int32),  # kv_lens
        jnp.asarray([[2, 0], [0, 0]], jnp.int32),  # page_indices
        jnp.asarray([0, 2, 2], jnp.int32),  # cu_q_lens
        jnp.asarray([1], jnp.int32),  # num_seqs
        sm_scale=LN3, impl=impl,
    )  # fmt: skip
    want = [[[1.0, 0.0]], [[0.75, 0.5]], [[0.0, 0.0]]]  # row 0 sees k0 only
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_flash_hand_case(impl):
    k = jnp.asarray([[[[1.0, 0.0]], [[0.0, 0.0]], [[NAN, NAN]]]])  # [B=1, Tk=3, Hkv=1, D=2]
    v = jnp.asarray([[[[1.0, 0.0]], [[0.0, 2.0]], [[NAN, NAN]]]])
    q = jnp.asarray([[[[1.0, 0.0]], [[1.0, 0.0]]]])  # [B=1, Tq=2, Hq=1, D=2]
    kv_lens = jnp.asarray([2], jnp.int32)
    out = jit_call(pk.flash_attention, q, k, v, kv_lens=kv_lens, sm_scale=LN3, impl=impl)
    np.testing.assert_allclose(np.asarray(out)[0, :, 0], [[1.0, 0.0], [0.75, 0.5]], atol=1e-6)
    out = jit_call(pk.flash_attention, q, k, v, kv_lens=kv_lens, causal=False, sm_scale=LN3,
                   impl=impl)
    np.testing.assert_allclose(np.asarray(out)[0, :, 0], [[0.75, 0.5], [0.75, 0.5]], atol=1e-6)


def _lengths(page, pages_per_seq):
    top = page * pages_per_seq
    return [0, 1, page - 1, page, page + 1, top - 1, top]


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hq,hkv,soft_cap", [(4, 4, None), (8, 2, 5.0), (4, 1, None)])
def test_paged_attention_vs_numpy(impl, dtype, hq, hkv, soft_cap):
    rng = np.random.default_rng(0)
    page, pps, d = 8, 4, 64
    case = testing.make_paged_case(
        rng, _lengths(page, pps), num_kv_heads=hkv, head_dim=d, page_size=page,
        pages_per_seq=pps, dtype=dtype,
    )  # fmt: skip
    q = testing.random_q(rng, (len(case.lengths), hq, d), dtype)
    kw = dict(sm_scale=d**-0.5, soft_cap=soft_cap)
    fn = jax.jit(lambda *a: pk.paged_attention(*a, **kw, impl=impl))
    out = fn(q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    assert out.dtype == jnp.dtype(dtype)
    want = testing.paged_attention_np(
        q, case.k_pages, case.v_pages, case.lengths, case.page_indices, **kw
    )
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol(dtype))


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("dtype,hq,hkv", [("float32", 8, 2), ("bfloat16", 4, 1), ("float32", 4, 4)])
def test_ragged_vs_numpy(impl, dtype, hq, hkv):
    rng = np.random.default_rng(1)
    d, page, pps = 64, 8, 4
    q, case, cu, n = testing.make_ragged_case(
        rng, testing.mixed_batch(page, pps), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        page_size=page, pages_per_seq=pps, dtype=dtype,
    )  # fmt: skip
    kw = dict(sm_scale=d**-0.5, soft_cap=None)
    fn = jax.jit(lambda *a: pk.ragged_paged_attention(*a, **kw, impl=impl))
    out = fn(q, case.k_pages, case.v_pages, case.lengths, case.page_indices, cu, n)
    want = testing.ragged_paged_attention_np(
        q, case.k_pages, case.v_pages, case.lengths, case.page_indices, cu, n, **kw
    )
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol(dtype))
    assert not np.any(np.asarray(out, np.float64)[cu[-1] :]), "padding rows must be zeros"


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize(
    "q_len,causal,dtype",
    [(1, True, "float32"), (5, True, "bfloat16"), (24, True, "float32"), (24, False, "float32")],
)
def test_flash_vs_numpy(impl, dtype, q_len, causal):
    rng = np.random.default_rng(2)
    batch, kv_len, hq, hkv, d = 3, 24, 8, 2, 64
    caster = testing._caster(dtype)
    k = caster(rng.standard_normal((batch, kv_len, hkv, d)))
    v = caster(rng.standard_normal((batch, kv_len, hkv, d)))
    kv_lens = np.asarray([kv_len, 17, q_len], np.int32)
    for b, n in enumerate(kv_lens):
        k[b, n:], v[b, n:] = np.nan, np.nan
    q = testing.random_q(rng, (batch, q_len, hq, d), dtype)
    kw = dict(kv_lens=kv_lens, causal=causal, sm_scale=0.2, soft_cap=30.0)
    cfg = dict(config=pk.XlaConfig(block_tokens=8, items_per_group=2)) if impl == "xla" else {}
    out = jax.jit(lambda *a: pk.flash_attention(*a, **kw, impl=impl, **cfg))(q, k, v)
    want = testing.flash_attention_np(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol(dtype))


def test_xla_blocks_match_reference():
    """Blocks smaller than the page table (several loop trips, padded last block) change nothing."""
    rng = np.random.default_rng(3)
    page, pps = 8, 5
    case = testing.make_paged_case(
        rng, [40, 17, 0, 9], num_kv_heads=2, head_dim=64, page_size=page, pages_per_seq=pps
    )
    q = testing.random_q(rng, (4, 4, 64))
    args = (q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    want = jit_call(reference.paged_attention, *args)
    for block in (1, 16, 24, 1000):
        got = jit_call(pk.paged_attention, *args, impl="xla",
                       config=pk.XlaConfig(block_tokens=block))
        np.testing.assert_allclose(got, want, **tol("float32"))


def test_traced_lengths_and_tables_under_jit():
    rng = np.random.default_rng(4)
    case = testing.make_paged_case(
        rng, [5, 9], num_kv_heads=1, head_dim=64, page_size=8, pages_per_seq=2
    )
    q = testing.random_q(rng, (2, 2, 64))
    fn = jax.jit(pk.paged_attention)
    out1 = fn(q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    out2 = fn(q[::-1], case.k_pages, case.v_pages, jnp.asarray([9, 5]), case.page_indices[::-1])
    np.testing.assert_allclose(out1, out2[::-1], **tol("float32"))


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(q=np.zeros((2, 3, 8), np.float32)), ValueError, "num_q_heads=3"),
        (dict(q=np.zeros((2, 4, 16), np.float32)), ValueError, "head_dim"),
        (dict(q=np.zeros((2, 4, 8), np.int32)), TypeError, "q.dtype"),
        (dict(q=np.zeros((2, 4, 8), np.float16)), TypeError, "k_pages.dtype"),
        (dict(lengths=np.zeros((3,), np.int32)), ValueError, "lengths.shape"),
        (dict(lengths=np.zeros((2,), np.float32)), TypeError, "lengths.dtype"),
        (dict(page_indices=np.zeros((2, 0), np.int32)), ValueError, "pages_per_seq=0"),
        (dict(sm_scale=-1.0), ValueError, "sm_scale=-1.0"),
        (dict(soft_cap=0.0), ValueError, "soft_cap=0.0"),
        (dict(impl="cuda"), ValueError, "impl='cuda'"),
        (dict(impl="pallas"), ValueError, "backend"),
    ],
)
def test_paged_attention_rejects_bad_inputs(kwargs, err, match):
    args = dict(
        q=np.zeros((2, 4, 8), np.float32),
        k_pages=np.zeros((2, 3, 4, 8), np.float32),
        v_pages=np.zeros((2, 3, 4, 8), np.float32),
        lengths=np.zeros((2,), np.int32),
        page_indices=np.zeros((2, 2), np.int32),
    )
    knobs = {}
    for key, val in kwargs.items():
        (args if key in args else knobs)[key] = val
    with pytest.raises(err, match=match):
        pk.paged_attention(*args.values(), **knobs)


def test_ragged_rejects_bad_inputs():
    k = np.zeros((1, 3, 4, 8), np.float32)
    q = np.zeros((5, 2, 8), np.float32)
    lens, table = np.zeros(2, np.int32), np.zeros((2, 2), np.int32)
    with pytest.raises(ValueError, match=r"cu_q_lens.shape=\(2,\)"):
        pk.ragged_paged_attention(q, k, k, lens, table, np.zeros(2, np.int32), 1)
    with pytest.raises(ValueError, match="num_seqs=3"):
        pk.ragged_paged_attention(q, k, k, lens, table, np.zeros(3, np.int32), 3)


def test_reference_is_the_numpy_ground_truth_on_mqa_large_page():
    """One larger shape (page 256, D=128, MQA) so the sweep's corners are exercised once."""
    rng = np.random.default_rng(5)
    page, pps = 256, 2
    case = testing.make_paged_case(
        rng, [1, 255, 256, 257, 512], num_kv_heads=1, head_dim=128, page_size=page,
        pages_per_seq=pps,
    )  # fmt: skip
    q = testing.random_q(rng, (5, 4, 128))
    args = (q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    want = testing.paged_attention_np(*args, sm_scale=128**-0.5)
    for impl in ("reference", "xla"):
        out = jit_call(pk.paged_attention, *args, sm_scale=128**-0.5, impl=impl)
        np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol("float32"))


@pytest.mark.parametrize("chunk,per_group,block", [(1, 1, 8), (2, 3, 16), (8, 8, 128)])
def test_xla_ragged_work_items_match_numpy(chunk, per_group, block):
    """Item chunking, group loop and block size of the ragged XLA path change nothing."""
    rng = np.random.default_rng(6)
    q, case, cu, n = testing.make_ragged_case(
        rng, testing.mixed_batch(8, 4), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
        pages_per_seq=4, pad_tokens=5,
    )  # fmt: skip
    args = (q, case.k_pages, case.v_pages, case.lengths, case.page_indices, cu, n)
    cfg = pk.XlaConfig(ragged_chunk=chunk, items_per_group=per_group, block_tokens=block)
    out = jax.jit(lambda *a: pk.ragged_paged_attention(*a, impl="xla", config=cfg))(*args)
    want = testing.ragged_paged_attention_np(*args)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol("float32"))


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_ragged_with_no_live_sequences_is_zero(impl):
    rng = np.random.default_rng(7)
    q, case, cu, _ = testing.make_ragged_case(
        rng, [(5, 2)], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=8, pages_per_seq=1
    )
    args = (q, case.k_pages, case.v_pages, case.lengths, case.page_indices, cu)
    out = jit_call(pk.ragged_paged_attention, *args, num_seqs=0, impl=impl)
    assert not np.any(np.asarray(out))


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_flash_prefill_default_kv_lens(impl):
    """kv_lens=None means every key is valid; Tq == Tk is plain causal prefill."""
    rng = np.random.default_rng(8)
    q = testing.random_q(rng, (2, 12, 4, 64))
    k, v = testing.random_q(rng, (2, 12, 2, 64)), testing.random_q(rng, (2, 12, 2, 64))
    out = jit_call(pk.flash_attention, q, k, v, sm_scale=0.125, impl=impl)
    want = testing.flash_attention_np(q, k, v, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol("float32"))
