"""Contiguous flash attention kernels (TPU- and GPU-style, interpret mode) vs float64 numpy."""

import numpy as np
import pytest
from tolerances import tol

import pallas_kernels as pk
from pallas_kernels import compat, testing
from pallas_kernels.flash_attention_gpu import GpuFlashConfig
from pallas_kernels.flash_attention_tpu import TpuFlashConfig


def _check(impl, *, q_len, causal, dtype, hq=8, hkv=2, d=64, kv_len=40, config=None):
    rng = np.random.default_rng(q_len + hq)
    caster = testing._caster(dtype)
    batch = 3
    k = caster(rng.standard_normal((batch, kv_len, hkv, d)))
    v = caster(rng.standard_normal((batch, kv_len, hkv, d)))
    kv_lens = np.asarray([kv_len, kv_len - 9, q_len], np.int32)  # the last: queries fill it
    for b, n in enumerate(kv_lens):
        k[b, n:], v[b, n:] = np.nan, np.nan
    q = testing.random_q(rng, (batch, q_len, hq, d), dtype)
    kw = dict(kv_lens=kv_lens, causal=causal, sm_scale=d**-0.5, soft_cap=25.0)
    out = pk.flash_attention(q, k, v, **kw, impl=impl, config=config)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not compat.races_found()
    want = testing.flash_attention_np(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol(dtype))


CASES = [(1, True, "float32"), (24, True, "bfloat16"), (40, False, "float32")]


@pytest.mark.parametrize("q_len,causal,dtype", CASES)
def test_tpu_style_interpret(q_len, causal, dtype):
    cfg = TpuFlashConfig(block_q=8, block_k=16)
    _check("interpret_tpu", q_len=q_len, causal=causal, dtype=dtype, config=cfg)


@pytest.mark.parametrize("q_len,causal,dtype", CASES)
def test_gpu_style_interpret(q_len, causal, dtype):
    cfg = GpuFlashConfig(block_q=8, block_k=16)
    _check("interpret_gpu", q_len=q_len, causal=causal, dtype=dtype, config=cfg)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["interpret_tpu", "interpret_gpu"])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("q_len", [1, 7, 40])
def test_sweep(impl, hq, hkv, d, q_len):
    _check(impl, q_len=q_len, causal=True, dtype="float32", hq=hq, hkv=hkv, d=d)
