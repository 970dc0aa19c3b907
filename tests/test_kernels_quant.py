"""Quantized KV pages in every attention path (reference, XLA, TPU-style and GPU-style Pallas in
interpret mode): paged decode and ragged prefill + decode + verify rows.

Two contracts per case:
  * against the float64 oracle on the *dequantized* pages, the float32 tolerance of every kernel;
  * against the *unquantized* float32 pages, a stated bound, rigorous for softmax attention: with
    ``dk = max |k_hat - k|``, ``dv = max |v_hat - v|`` (over stored keys) and
    ``delta = sm_scale * max_row ||q_row||_1 * dk`` (a bound on any logit's change; a soft cap is
    1-Lipschitz), every output element moves by at most ``dv + (exp(2 delta) - 1) * max |v|``.
Unused storage is NaN, so a read past a length or of a stale scale spoils the output.
"""

import numpy as np
import pytest
from jit_utils import jit_call
from tolerances import tol

import pallas_kernels as pk
from pallas_kernels import compat, quant, testing
from pallas_kernels.gpu_common import GpuPagedConfig
from pallas_kernels.tpu_common import TpuPagedConfig

IMPLS = {
    "reference": None,
    "xla": None,
    "interpret_tpu": TpuPagedConfig(pages_per_compute_block=2, queries_per_block=8),
    "interpret_gpu": GpuPagedConfig(pages_per_compute_block=2),
}
# (kv dtype, scale granularity, page size, q heads, kv heads): every dtype and granularity, page
# sizes 8 and 16, GQA and MHA.
CASES = [
    ("int8", "token", 8, 4, 2),
    ("int8", "page", 16, 2, 2),
    ("fp8_e4m3", "page", 8, 2, 2),
    ("fp8_e4m3", "token", 16, 4, 1),
    ("fp8_e5m2", "token", 8, 2, 2),
    ("fp8_e5m2", "page", 16, 4, 2),
]
D = 64
PPS = 3


def _quantize(case, name, granularity):
    dtype = quant.storage_dtype(name)
    kq, vq = (jit_call(quant.quantize_pool, np.asarray(x), dtype=dtype, granularity=granularity)
              for x in (case.k_pages, case.v_pages))
    return kq, vq


def _bound(q, case, kq, vq, sm_scale):
    k_hat, v_hat = (np.asarray(jit_call(quant.dequantize, x), np.float64) for x in (kq, vq))
    k, v = (np.asarray(x, np.float64) for x in (case.k_pages, case.v_pages))
    dk, dv = np.nanmax(np.abs(k_hat - k)), np.nanmax(np.abs(v_hat - v))
    delta = sm_scale * np.abs(np.asarray(q, np.float64)).sum(-1).max() * dk
    return dv + np.expm1(2 * delta) * np.nanmax(np.abs(v))


def _check(out, q, case, kq, vq, want_dequantized, want_exact, sm_scale):
    out = np.asarray(out, np.float64)
    assert not compat.races_found()
    np.testing.assert_allclose(out, want_dequantized, **tol(np.float32))
    err = np.max(np.abs(out - want_exact))
    assert 0 < err <= _bound(q, case, kq, vq, sm_scale)


# The jnp reference is checked on the hand-computed case below; its sweep runs with -m slow.
SWEPT = [pytest.param(i, marks=pytest.mark.slow) if i == "reference" else i for i in IMPLS]


@pytest.mark.parametrize("impl", SWEPT)
@pytest.mark.parametrize("name, granularity, page, hq, hkv", CASES)
def test_paged_decode(impl, name, granularity, page, hq, hkv):
    rng = np.random.default_rng(page + hq)
    lengths = [1, page, 2 * page + 3, PPS * page]
    case = testing.make_paged_case(rng, lengths, num_kv_heads=hkv, head_dim=D, page_size=page,
                                   pages_per_seq=PPS)
    q = testing.random_q(rng, (len(lengths), hq, D))
    kq, vq = _quantize(case, name, granularity)
    sm_scale = D**-0.5
    out = jit_call(pk.paged_attention, q, kq, vq, case.lengths, case.page_indices,
                   sm_scale=sm_scale, impl=impl, config=IMPLS[impl])
    assert out.dtype == q.dtype
    deq = [np.asarray(jit_call(quant.dequantize, x)) for x in (kq, vq)]
    want = testing.paged_attention_np(q, *deq, case.lengths, case.page_indices, sm_scale=sm_scale)
    exact = testing.paged_attention_np(q, case.k_pages, case.v_pages, case.lengths,
                                       case.page_indices, sm_scale=sm_scale)
    _check(out, q, case, kq, vq, want, exact, sm_scale)


@pytest.mark.parametrize("impl", SWEPT)
@pytest.mark.parametrize("name, granularity, page, hq, hkv", CASES[::2] + CASES[1::2][:1])
def test_ragged_prefill_decode_verify(impl, name, granularity, page, hq, hkv):
    rng = np.random.default_rng(page + hq + 1)
    q, case, cu, n = testing.make_ragged_case(
        rng, testing.mixed_batch(page, PPS), num_q_heads=hq, num_kv_heads=hkv, head_dim=D,
        page_size=page, pages_per_seq=PPS)
    kq, vq = _quantize(case, name, granularity)
    sm_scale = D**-0.5
    args = (case.lengths, case.page_indices, cu, n)
    out = jit_call(pk.ragged_paged_attention, q, kq, vq, *args, sm_scale=sm_scale,
                   soft_cap=20.0, impl=impl, config=IMPLS[impl])
    deq = [np.asarray(jit_call(quant.dequantize, x)) for x in (kq, vq)]
    want = testing.ragged_paged_attention_np(q, *deq, *args, sm_scale=sm_scale, soft_cap=20.0)
    exact = testing.ragged_paged_attention_np(q, case.k_pages, case.v_pages, *args,
                                              sm_scale=sm_scale, soft_cap=20.0)
    live = slice(0, int(cu[-1]))
    _check(np.asarray(out)[live], q[live], case, kq, vq, want[live], exact[live], sm_scale)
    assert not np.any(np.asarray(out)[cu[-1]:]), "padding rows must be zeros"


def test_a_scale_is_read_where_it_belongs():
    # Hand-computed: two keys in one page, per-token scales 2 and 4; a wrong scale index, or a
    # scale read from the wrong page, changes the answer.
    values = np.zeros((1, 2, 8, 64), np.int8)  # [Hkv, P, page, D]; page 0 is the null page
    values[0, 1, 0, 0], values[0, 1, 1, 0] = 1, 1
    scales = np.full((1, 2, 8), np.nan, np.float32)
    scales[0, 1, :2] = [2.0, 4.0]
    pages = quant.QuantizedPages(values, scales)
    q = np.zeros((1, 1, 64), np.float32)  # equal scores: the output is the mean of the values
    for impl in IMPLS:
        out = jit_call(pk.paged_attention, q, pages, pages, np.array([2], np.int32),
                       np.array([[1, 0]], np.int32), impl=impl, config=IMPLS[impl])
        np.testing.assert_allclose(np.asarray(out)[0, 0, 0], 3.0, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(out)[0, 0, 1:], 0.0)


def test_mismatched_or_malformed_quantized_pages_are_refused():
    pages = quant.quantize_pool(np.ones((1, 2, 8, 64), np.float32), np.int8, "token")
    q = np.zeros((1, 1, 64), np.float32)
    args = (np.array([2], np.int32), np.array([[1]], np.int32))
    with pytest.raises(TypeError, match="both be QuantizedPages"):
        pk.paged_attention(q, pages, np.ones((1, 2, 8, 64), np.float32), *args)
    bad = quant.QuantizedPages(pages.values, pages.scales[..., :3])
    with pytest.raises(ValueError, match="scales.shape"):
        pk.paged_attention(q, bad, bad, *args)
    wide = quant.QuantizedPages(pages.values.astype(np.int16), pages.scales)
    with pytest.raises(TypeError, match="values.dtype"):
        pk.paged_attention(q, wide, wide, *args)
