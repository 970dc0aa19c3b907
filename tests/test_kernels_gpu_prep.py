"""CPU checks of what the next GPU run relies on: the decode split heuristic, the dispatcher using
it when no splits are given, and the read-only roofline compiling to a single pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import gpu_tuning, testing
from pallas_kernels.gpu_common import GpuPagedConfig


def test_heuristic_reproduces_the_h200_sweep():
    """B=64, Hkv=8, context 4096, page 16 on 132 SMs: 2 splits x 8 pages per block was best."""
    assert gpu_tuning.decode_splits(64, 8, 4096, 16, num_sms=132) == (2, 8)


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
@pytest.mark.parametrize("context", [1024, 4096, 16384])
def test_heuristic_fills_the_sms_without_tiny_splits(batch, context):
    splits, ppb = gpu_tuning.decode_splits(batch, 8, context, 16, num_sms=132)
    pages = context // 16
    assert splits & (splits - 1) == 0 and ppb & (ppb - 1) == 0
    assert ppb * 16 == 128  # 128 keys per compute block
    assert pages // splits >= 2 * ppb  # at least two compute blocks per split
    at_floor = pages // (2 * splits) < 2 * ppb  # doubling would leave < 2 blocks per split
    assert batch * 8 * splits >= 2 * 132 or at_floor  # else the occupancy target is met
    assert splits >= context // 2048  # no split walks more than 2048 keys (unless at the floor)
    # Small batches split more than large ones at the same context.
    assert splits >= gpu_tuning.decode_splits(batch * 2, 8, context, 16, num_sms=132)[0]


def test_heuristic_edge_cases():
    assert gpu_tuning.decode_splits(1, 1, 16, 16) == (1, 1)  # one page: nothing to split
    assert gpu_tuning.decode_splits(1, 8, 1 << 20, 16)[0] == 64  # capped at max_splits
    assert gpu_tuning.decode_splits(1, 8, 4096, 256)[1] == 1  # big pages: one page per block
    with pytest.raises(ValueError, match="batch=0"):
        gpu_tuning.decode_splits(0, 8, 4096, 16)


def test_explicit_config_values_override_the_heuristic():
    kw = {"batch": 64, "num_kv_heads": 8, "pages_per_seq": 256, "page_size": 16, "num_sms": 132}
    auto = gpu_tuning.resolve_decode_config(GpuPagedConfig(), **kw)
    assert (auto.k_splits, auto.pages_per_compute_block) == (2, 8)
    fixed = gpu_tuning.resolve_decode_config(GpuPagedConfig(k_splits=4), **kw)
    assert (fixed.k_splits, fixed.pages_per_compute_block) == (4, 8)
    both = GpuPagedConfig(k_splits=16, pages_per_compute_block=4)
    assert gpu_tuning.resolve_decode_config(both, **kw) is both


def test_interpret_gpu_decode_with_heuristic_splits_matches_float64():
    """The kernel with k_splits / pages_per_compute_block left to the heuristic (here several
    splits: B=1, long enough context) gives the float64 answer."""
    rng = np.random.default_rng(0)
    lengths = [1000]
    case = testing.make_paged_case(rng, lengths, num_kv_heads=2, head_dim=16, page_size=8,
                                   pages_per_seq=128, extra_pages=2)  # fmt: skip
    cfg = gpu_tuning.resolve_decode_config(GpuPagedConfig(), batch=1, num_kv_heads=2,
                                           pages_per_seq=128, page_size=8)  # fmt: skip
    assert cfg.k_splits > 1
    q = testing.random_q(rng, (1, 4, 16), "float32")
    got = pk.paged_attention(q, case.k_pages, case.v_pages, case.lengths, case.page_indices,
                             sm_scale=0.25, impl="interpret_gpu")  # fmt: skip
    want = testing.paged_attention_np(q, case.k_pages, case.v_pages, case.lengths,
                                      case.page_indices, sm_scale=0.25)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_read_roofline_is_one_pass(dtype):
    """The read-only reduction reads each pool byte once by XLA's own count and materialises
    nothing of pool size (no float32 copy of a bf16 pool)."""
    from experiments import kernel_bench_lib as lib

    k = jnp.ones((2, 64, 16, 128), dtype)
    v = jnp.full((2, 64, 16, 128), 2, dtype)
    fn = lib.read_fn()
    chk = lib.read_pass_check(fn, k, v)
    assert chk["single_pass"], chk
    assert chk["pool_bytes"] <= chk["xla_bytes_accessed"] <= 1.01 * chk["pool_bytes"] + 4096
    assert not chk["pool_sized_intermediates"]
    sk, sv = fn(k, v)
    assert float(sk) == k.size and float(sv) == 2 * v.size
    # The check does catch a two-pass program.
    two_pass = jax.jit(lambda k, v: (jnp.sum(jnp.sin(k.astype(jnp.float32)) + k.astype(jnp.float32).T.sum()),
                                     jnp.sum(v)))  # fmt: skip
    assert not lib.read_pass_check(two_pass, k, v)["single_pass"]


def test_roofline_fractions():
    from experiments import kernel_bench_lib as lib

    entry = {"achieved_gbps": 2000.0}
    lib.roofline_fractions(entry, read_gbps=4000.0, copy_gbps=2500.0, datasheet_gbps=4800.0)
    assert entry == {"achieved_gbps": 2000.0, "frac_of_read_roofline": 0.5, "frac_of_copy": 0.8,
                     "frac_of_datasheet": 2000.0 / 4800.0}  # fmt: skip
    entry = {"achieved_gbps": 1.0}
    lib.roofline_fractions(entry, read_gbps=None, copy_gbps=2.0, datasheet_gbps=4.0)
    assert "frac_of_read_roofline" not in entry and entry["frac_of_copy"] == 0.5


def test_h200_grid_config():
    from experiments import kernel_bench_lib as lib
    from experiments.configs import kernel_bench

    c = kernel_bench.get_config("h200")
    shapes = lib.grid_shapes(c)
    assert len(shapes) == 24 and shapes[0] == ("bfloat16", 1024, 1)
    assert {s[0] for s in shapes} == {"bfloat16", "float32"}
    assert c.decode_grid.compare_to in c.decode_grid.impls and c.datasheet_gbps == 4800.0
    assert c.gpu_k_splits == 4  # the explicit value stays for the main decode shape
    assert "pallas_gpu@heuristic" in c.decode_impls
