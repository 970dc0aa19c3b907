"""Paged decode kernels (TPU- and GPU-style Pallas, interpret mode on CPU) vs float64 numpy.

Every case packs the boundary lengths (0, 1, page-1, page, page+1, max-1, max) into one batch and
fills unused pages, the null page and slots past each length with NaN, so a kernel that reads a
position it must not turns its output NaN. JAX's own Pallas paged-attention kernels run on the same
arrays with the NaN garbage zeroed: they read whole compute blocks and multiply masked
probabilities into the values, so NaN past a length leaks into their output (checked below).
"""

import itertools
import re

import jax
import numpy as np
import pytest
from tolerances import tol

import pallas_kernels as pk
from pallas_kernels import compat, testing
from pallas_kernels.gpu_common import GpuPagedConfig
from pallas_kernels.tpu_common import TpuPagedConfig

PPS = 3  # pages per sequence: keeps interpret mode fast while crossing page boundaries


def boundary_lengths(page, pages_per_seq=PPS):
    top = page * pages_per_seq
    return sorted({0, 1, page - 1, page, page + 1, top - 1, top})


def _case(seed, *, dtype, hq, hkv, page, d, pps=PPS):
    rng = np.random.default_rng(seed)
    case = testing.make_paged_case(
        rng, boundary_lengths(page, pps), num_kv_heads=hkv, head_dim=d, page_size=page,
        pages_per_seq=pps, dtype=dtype,
    )  # fmt: skip
    q = testing.random_q(rng, (len(case.lengths), hq, d), dtype)
    return q, case


def _check(impl, *, dtype, hq, hkv, page, d, soft_cap=None, config=None, jit=False):
    q, case = _case(page + d + hq, dtype=dtype, hq=hq, hkv=hkv, page=page, d=d)
    args = (q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    kw = dict(sm_scale=d**-0.5, soft_cap=soft_cap)
    fn = lambda *a: pk.paged_attention(*a, **kw, impl=impl, config=config)  # noqa: E731
    out = (jax.jit(fn) if jit else fn)(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not compat.races_found()
    want = testing.paged_attention_np(*args, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol(dtype))
    return out


# (dtype, hq, hkv, page, head_dim, soft_cap): GQA, MQA, MHA; pages 8..256; D 64 and 128.
DEFAULT = [
    ("float32", 8, 2, 8, 64, None),
    ("bfloat16", 4, 1, 16, 128, 20.0),
    ("float32", 4, 4, 256, 128, None),
]


@pytest.mark.parametrize("dtype,hq,hkv,page,d,soft_cap", DEFAULT)
def test_tpu_style_interpret(dtype, hq, hkv, page, d, soft_cap):
    # Several blocks, a partial last one; two simulated cores once (grid steps share no state).
    cfg = TpuPagedConfig(pages_per_compute_block=2, interpret_cores=2 if page == 8 else 1)
    _check("interpret_tpu", dtype=dtype, hq=hq, hkv=hkv, page=page, d=d, soft_cap=soft_cap,
           config=cfg, jit=page == 8)  # fmt: skip


@pytest.mark.parametrize("dtype,hq,hkv,page,d,soft_cap", DEFAULT)
def test_gpu_style_interpret(dtype, hq, hkv, page, d, soft_cap):
    cfg = GpuPagedConfig(pages_per_compute_block=2, k_splits=2)
    _check("interpret_gpu", dtype=dtype, hq=hq, hkv=hkv, page=page, d=d, soft_cap=soft_cap,
           config=cfg, jit=page == 8)  # fmt: skip


def test_gpu_style_unmasked_gather_fallback():
    """The JAX-style gather (null page instead of a masked load) gives the same result."""
    cfg = GpuPagedConfig(pages_per_compute_block=2, k_splits=2, masked_gather=False)
    _check("interpret_gpu", dtype="float32", hq=8, hkv=2, page=8, d=64, config=cfg)


def test_tpu_style_splits_the_page_table_prefetch():
    """A table bigger than the SMEM bound runs as several batch chunks, same result."""
    cfg = TpuPagedConfig(pages_per_compute_block=3, max_prefetch_entries=4 * PPS)
    _check("interpret_tpu", dtype="float32", hq=2, hkv=1, page=8, d=64, config=cfg)


def test_interpret_means_tpu_style():
    assert pk.resolve_impl("interpret") == ("pallas", "tpu", True)
    assert pk.resolve_impl("auto", "cpu") == ("xla", None, False)
    assert pk.resolve_impl("auto", "gpu") == ("pallas", "gpu", False)
    assert pk.resolve_impl("auto", "tpu") == ("pallas", "tpu", False)
    assert pk.resolve_impl("pallas", "gpu") == ("pallas", "gpu", False)


@pytest.mark.parametrize(
    "impl, page, d, dtype, match",
    [
        ("interpret_tpu", 8, 64, "bfloat16", "page_size=8 must be a multiple of 16"),
        ("interpret_tpu", 12, 64, "float32", "page_size=12"),
        ("interpret_tpu", 8, 80, "float32", "head_dim=80"),
        ("interpret_tpu", 512, 64, "float32", "page_size=512"),
        ("interpret_gpu", 24, 64, "float32", "page_size=24 must be a power of two"),
        ("interpret_gpu", 8, 96, "float32", "head_dim=96"),
    ],
)
def test_backend_constraints_raise(impl, page, d, dtype, match):
    q = np.zeros((1, 2, d), np.float32)
    pages = np.zeros((1, 2, page, d), np.float32)
    if dtype == "bfloat16":
        q, pages = testing._caster(dtype)(q), testing._caster(dtype)(pages)
    with pytest.raises(ValueError, match=match):
        pk.paged_attention(
            q, pages, pages, np.ones(1, np.int32), np.ones((1, 1), np.int32), impl=impl
        )


def test_config_knobs_are_checked():
    with pytest.raises(ValueError, match="pages_per_compute_block=0"):
        TpuPagedConfig(pages_per_compute_block=0)
    with pytest.raises(ValueError, match="k_splits=3"):
        GpuPagedConfig(k_splits=3)
    with pytest.raises(ValueError, match="vmem_limit_bytes"):
        pk.paged_attention(
            *_case(0, dtype="float32", hq=2, hkv=1, page=256, d=128)[:1],
            *[np.zeros((1, 2, 256, 128), np.float32)] * 2, np.ones(7, np.int32),
            np.ones((7, 1), np.int32), impl="interpret_tpu",
            config=TpuPagedConfig(vmem_limit_bytes=1024),
        )  # fmt: skip


def _zeroed(case):
    return np.nan_to_num(case.k_pages), np.nan_to_num(case.v_pages)


def test_same_arrays_as_jax_gpu_paged_attention():
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu

    q, case = _case(7, dtype="float32", hq=8, hkv=2, page=8, d=64, pps=4)
    keep = case.lengths > 0  # JAX's kernel divides by l + eps: zero lengths are not comparable
    q, lengths, table = q[keep], case.lengths[keep], case.page_indices[keep]
    k, v = _zeroed(case)
    theirs = jax_gpu.paged_attention(
        q, k, v, table, lengths, pages_per_compute_block=2, k_splits=2, interpret=True
    )
    ours = pk.paged_attention(q, k, v, lengths, table, impl="interpret_gpu")
    np.testing.assert_allclose(ours, theirs, **tol("float32"))
    # Same call on the NaN-filled arrays: ours stays finite, JAX's reads past the lengths.
    nan_theirs = jax_gpu.paged_attention(
        q, case.k_pages, case.v_pages, table, lengths, pages_per_compute_block=2, k_splits=2,
        interpret=True,
    )  # fmt: skip
    assert np.isnan(np.asarray(nan_theirs)).any()


def test_same_arrays_as_jax_tpu_paged_attention():
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_tpu

    q, case = _case(8, dtype="float32", hq=8, hkv=2, page=8, d=64, pps=4)
    k, v = _zeroed(case)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        theirs = jax_tpu(q, k, v, case.lengths, case.page_indices, pages_per_compute_block=2)
    ours = pk.paged_attention(q, k, v, case.lengths, case.page_indices, impl="interpret_tpu")
    # JAX's TPU kernel rounds K/V to bfloat16 inside (its dequantise step), hence bf16 tolerance.
    np.testing.assert_allclose(ours, theirs, **tol("bfloat16"))


def test_tpu_interpret_race_detector_is_live():
    """Guards the guard: a kernel that reads a DMA target before waiting is flagged."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]
        copy.wait()

    pl.pallas_call(
        racy, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=compat.tpu_interpret_params(),
    )(jnp.ones((8, 128), jnp.float32))  # fmt: skip
    assert compat.races_found()
    compat.clear_races()
    assert not compat.races_found()


SWEEP = [
    (dtype, hq, hkv, page, d)
    for dtype, (hq, hkv), page, d in itertools.product(
        ["float32", "bfloat16"], [(4, 4), (8, 2), (8, 1)], [8, 16, 64, 256], [64, 128]
    )
]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["interpret_tpu", "interpret_gpu", "xla"])
@pytest.mark.parametrize("dtype,hq,hkv,page,d", SWEEP)
def test_sweep(impl, dtype, hq, hkv, page, d):
    if impl == "interpret_tpu" and dtype == "bfloat16" and page % 16:
        pytest.skip("TPU-style kernel needs page_size % 16 == 0 for 16-bit dtypes")
    # "xla": two pages a block, so the (slot, page) order and a partial last block are exercised.
    cfg = pk.XlaConfig(block_tokens=2 * page) if impl == "xla" else None
    _check(impl, dtype=dtype, hq=hq, hkv=hkv, page=page, d=d, soft_cap=None, config=cfg,
           jit=impl == "xla")  # fmt: skip


@pytest.mark.parametrize(
    "dtype,page,block,hq,hkv",
    [
        ("float32", 1, 8, 4, 2),  # one-token pages: a block interleaves 8 pages
        ("float32", 16, 48, 8, 2),  # 3 pages a block, partial last block
        ("bfloat16", 32, 128, 4, 1),  # MQA
        ("float32", 8, 1000, 4, 4),  # one block covers the table
    ],
)
def test_xla_blocks_in_slot_page_order_and_stacked_layer(dtype, page, block, hq, hkv):
    """The "xla" path reads a block's keys in (slot, page) order: any page size and block size,
    NaN past each length, the stacked-cache ``layer=`` path agrees with the plain one."""
    pps = 5
    q, case = _case(page + block, dtype=dtype, hq=hq, hkv=hkv, page=page, d=64, pps=pps)
    kw = dict(sm_scale=0.125, soft_cap=30.0, impl="xla", config=pk.XlaConfig(block_tokens=block))
    args = (q, case.k_pages, case.v_pages, case.lengths, case.page_indices)
    out = jax.jit(lambda *a: pk.paged_attention(*a, **kw))(*args)
    want = testing.paged_attention_np(*args, sm_scale=0.125, soft_cap=30.0)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tol(dtype))
    k_all, v_all = (np.stack([np.full_like(x, np.nan), x]) for x in (case.k_pages, case.v_pages))
    stacked = jax.jit(lambda q, k, v, n, t: pk.paged_attention(q, k, v, n, t, **kw, layer=1))(
        q, k_all, v_all, case.lengths, case.page_indices
    )
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(out))


def _materialised_f32(hlo: str, shape) -> bool:
    """Whether a top-level op of ``hlo`` writes a float32 array of ``shape`` (a convert fused into
    a gather's fusion computes only the gathered elements and does not count)."""
    dims = ",".join(map(str, shape))
    return re.search(rf"= f32\[{dims}\]\{{[^}}]*\}} fusion\(", hlo) is not None


def test_xla_bf16_never_converts_the_whole_cache():
    """XLA:CPU widens a bf16 gather/slice operand to f32; hoisted out of the block loop that
    converts the whole cache on every call (measured 4x slower). Only tiles may be converted."""
    import jax.numpy as jnp

    from pallas_kernels import xla

    q, case = _case(3, dtype="bfloat16", hq=4, hkv=2, page=8, d=64, pps=4)
    k_all, v_all = (jnp.stack([x, x]) for x in (case.k_pages, case.v_pages))
    paged = jax.jit(lambda q, k, v, n, t: pk.paged_attention(q, k, v, n, t, impl="xla", layer=1))
    hlo = paged.lower(q, k_all, v_all, case.lengths, case.page_indices).compile().as_text()
    assert not _materialised_f32(hlo, k_all.shape) and not _materialised_f32(hlo, k_all.shape[1:])
    k_dense = jnp.asarray(case.k_dense)
    dense = jax.jit(lambda q, k, v: xla.flash_attention(q, k, v))
    hlo = dense.lower(q[:, None], k_dense, k_dense).compile().as_text()
    assert not _materialised_f32(hlo, k_dense.shape)
