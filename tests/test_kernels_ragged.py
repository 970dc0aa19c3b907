"""Ragged paged attention kernels (TPU- and GPU-style, interpret mode) vs float64 numpy.

One mixed batch per case: a prefill from empty, a mid-sequence chunk, decodes at page edges, an
empty slot, a verification of 4 tokens ending at the table's last slot, idle slots past num_seqs
and padding rows; unused storage is NaN.
"""

import itertools

import jax
import numpy as np
import pytest
from tolerances import tol

import pallas_kernels as pk
from pallas_kernels import compat, testing
from pallas_kernels.gpu_common import GpuPagedConfig
from pallas_kernels.tpu_common import TpuPagedConfig

PPS = 3


def _check(impl, *, dtype, hq, hkv, page, d, soft_cap=None, config=None, jit=False, as_int=False):
    rng = np.random.default_rng(page + d + hq)
    q, case, cu, n = testing.make_ragged_case(
        rng, testing.mixed_batch(page, PPS), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        page_size=page, pages_per_seq=PPS, dtype=dtype,
    )  # fmt: skip
    args = (q, case.k_pages, case.v_pages, case.lengths, case.page_indices, cu)
    kw = dict(sm_scale=d**-0.5, soft_cap=soft_cap)
    fn = lambda *a: pk.ragged_paged_attention(*a, **kw, impl=impl, config=config)  # noqa: E731
    out = (jax.jit(fn) if jit else fn)(*args, int(n[0]) if as_int else n)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not compat.races_found()
    want = testing.ragged_paged_attention_np(*args, n, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol(dtype))
    assert not np.any(np.asarray(out, np.float64)[cu[-1] :]), "padding rows must be zeros"


DEFAULT = [
    ("float32", 8, 2, 8, 64, 10.0),
    ("bfloat16", 4, 1, 16, 128, None),
]


@pytest.mark.parametrize("dtype,hq,hkv,page,d,soft_cap", DEFAULT)
def test_tpu_style_interpret(dtype, hq, hkv, page, d, soft_cap):
    cfg = TpuPagedConfig(
        pages_per_compute_block=2, queries_per_block=8, interpret_cores=2 if page == 8 else 1
    )
    _check("interpret_tpu", dtype=dtype, hq=hq, hkv=hkv, page=page, d=d, soft_cap=soft_cap,
           config=cfg, jit=page == 8)  # fmt: skip


@pytest.mark.parametrize("dtype,hq,hkv,page,d,soft_cap", DEFAULT)
def test_gpu_style_interpret(dtype, hq, hkv, page, d, soft_cap):
    cfg = GpuPagedConfig(pages_per_compute_block=2, queries_per_block=4)
    _check("interpret_gpu", dtype=dtype, hq=hq, hkv=hkv, page=page, d=d, soft_cap=soft_cap,
           config=cfg, jit=page == 8, as_int=True)  # fmt: skip


def test_tpu_style_splits_sequence_slots_over_calls():
    """A table past the SMEM bound runs as several slot groups whose outputs are summed."""
    cfg = TpuPagedConfig(
        pages_per_compute_block=3, queries_per_block=16, max_prefetch_entries=5 * PPS
    )
    _check("interpret_tpu", dtype="float32", hq=4, hkv=4, page=8, d=64, config=cfg)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["interpret_tpu", "interpret_gpu", "xla"])
@pytest.mark.parametrize(
    "dtype,hq,hkv,page,d",
    [
        (dtype, hq, hkv, page, d)
        for dtype, (hq, hkv), page, d in itertools.product(
            ["float32", "bfloat16"], [(4, 4), (8, 2), (8, 1)], [16, 64], [64, 128]
        )
    ],
)
def test_sweep(impl, dtype, hq, hkv, page, d):
    # "xla": two pages a block, so the (slot, page) order and a partial last block are exercised.
    cfg = pk.XlaConfig(block_tokens=2 * page) if impl == "xla" else None
    _check(impl, dtype=dtype, hq=hq, hkv=hkv, page=page, d=d, config=cfg, jit=impl == "xla")
