"""The quantized KV cache's device operations: the write quantizes with history-free scales, and
copy-on-write, swap out / in and NaN poison move each page's scales with its values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.kv import cache as kc
from pallas_kernels import quant

L, HKV, P, PAGE, D = 2, 2, 6, 4, 8


def _cache(name="int8", granularity="page"):
    return kc.KVCache.create(L, HKV, P, PAGE, D, kv_cache_dtype=name, scale_granularity=granularity)


def _tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(L, n, HKV, D)), jnp.float32),
            jnp.asarray(rng.normal(size=(L, n, HKV, D)), jnp.float32))


def _leaves(cache):
    return [np.asarray(x) for x in jax.tree.leaves(cache)]


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["token", "page"])
def test_a_page_written_in_chunks_reads_back_as_one_write(name, granularity):
    k, v = _tokens(6)
    slots = np.array([8, 9, 10, 11, 12, 13], np.int32)  # pages 2 and 3 (offsets 0..3, 0..1)
    whole = kc.write(_cache(name, granularity), k, v, slots)
    chunked = _cache(name, granularity)
    for lo, hi in ((0, 1), (1, 3), (3, 5), (5, 6)):
        chunked = kc.write(chunked, k[:, lo:hi], v[:, lo:hi], slots[lo:hi])
    for a, b in zip(_leaves(whole), _leaves(chunked), strict=True):
        np.testing.assert_array_equal(a, b)
    # A rolled-back draft at offset 0 is forgotten once the position is written again.
    redo = kc.write(_cache(name, granularity), -3 * k[:, :1], v[:, :1], slots[:1])
    redo = kc.write(redo, k, v, slots)
    for a, b in zip(_leaves(whole), _leaves(redo), strict=True):
        np.testing.assert_array_equal(a, b)
    # What the cache reads back is what the no-cache reference quantizes to.
    got_k, _ = kc.gather(whole, [2, 3], 6)  # [L, 6, Hkv, D]
    want = quant.fake_quantize_sequence(k, quant.storage_dtype(name),  # layers as the batch
                                        granularity, PAGE)
    np.testing.assert_allclose(got_k, np.asarray(want), rtol=1e-6, atol=1e-7)


def test_page_scales_are_fixed_by_the_first_token_with_headroom():
    k, v = _tokens(2)
    cache = kc.write(_cache("int8", "page"), k, v, np.array([4, 5], np.int32))
    want = np.max(np.abs(np.asarray(k[:, 0])), axis=-1) * quant.PAGE_SCALE_HEADROOM / 127
    np.testing.assert_allclose(np.asarray(cache.k_pages.scales)[:, :, 1, 0], want, rtol=1e-6)


def test_copy_swap_and_poison_move_scales_with_values():
    k, v = _tokens(8, seed=1)
    cache = kc.write(_cache("int8", "token"), k, v, np.arange(4, 12, dtype=np.int32))  # pages 1, 2
    before = kc.gather(cache, [1, 2], 8)
    cache = kc.copy_pages(cache, [1, 2], [3, 4])
    for a, b in zip(before, kc.gather(cache, [3, 4], 8), strict=True):
        np.testing.assert_array_equal(a, b)
    host_k, host_v = kc.host_buffers(cache, 3)
    out_k, out_v = kc.swap_out(cache, [1, 2])
    kc.host_set(host_k, [0, 2], out_k)
    kc.host_set(host_v, [0, 2], out_v)
    cache = kc.poison(cache, [1, 2, 3, 4])
    assert np.isnan(kc.gather(cache, [1], 4)[0]).all()  # int8 values + NaN scales read as NaN
    cache = kc.swap_in(cache, [5, 4], kc.host_get(host_k, [0, 2]), kc.host_get(host_v, [0, 2]))
    for a, b in zip(before, kc.gather(cache, [5, 4], 8), strict=True):
        np.testing.assert_array_equal(a, b)


def test_swap_in_refuses_plain_pages_for_a_quantized_cache():
    cache = _cache()
    with pytest.raises(ValueError, match="structure"):
        kc.swap_in(cache, [1], np.zeros((L, HKV, 1, PAGE, D), np.float32),
                   np.zeros((L, HKV, 1, PAGE, D), np.float32))
