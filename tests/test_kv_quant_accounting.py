"""Byte formulas of quantized KV: exact against the allocated arrays' ``nbytes``, scales included;
the ledger's ``scales`` category; the page count a byte budget affords per KV dtype."""

from __future__ import annotations

import pytest

from paged import accounting
from paged.kv import cache as kc
from pallas_kernels import quant

L, HKV, D = 2, 3, 16


@pytest.mark.parametrize("page", [8, 16])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["token", "page"])
def test_kv_bytes_equal_the_allocated_arrays(kv_cache_dtype, granularity, page):
    num_pages = 5
    cache = kc.KVCache.create(L, HKV, num_pages, page, D, "bfloat16",
                              kv_cache_dtype=kv_cache_dtype, scale_granularity=granularity)
    spec = accounting.ModelSpec(L, HKV, D, "bfloat16", kv_cache_dtype=kv_cache_dtype,
                                scale_granularity=granularity)
    want = accounting.kv_bytes(spec, num_pages * page, page_size=page)
    assert want == cache.nbytes
    assert spec.bytes_per_block(page) * num_pages == cache.nbytes
    assert spec.scale_bytes_per_block(page) * num_pages == cache.scale_nbytes
    # The keywords override the spec's own layout.
    plain = accounting.ModelSpec(L, HKV, D, "bfloat16")
    assert accounting.kv_bytes(plain, num_pages * page, kv_cache_dtype=kv_cache_dtype,
                               scale_granularity=granularity, page_size=page) == cache.nbytes


def test_hand_computed_bytes_and_the_plain_formula_is_unchanged():
    spec = accounting.ModelSpec(32, 8, 128, "bfloat16")  # Llama-3-8B's KV shape
    assert accounting.kv_bytes(spec, 1000) == accounting.kv_bytes(32, 1000, 8, 128, 2) == \
        2 * 32 * 1000 * 8 * 128 * 2
    # int8, token scales: 128 value bytes + 4 scale bytes per (token, head, K/V, layer).
    assert accounting.kv_bytes(spec, 1000, kv_cache_dtype="int8") == 2 * 32 * 1000 * 8 * (128 + 4)
    # int8, page scales: 4 bytes per (page, head); 1000 tokens in pages of 16 = 63 pages.
    assert accounting.kv_bytes(spec, 1000, kv_cache_dtype="int8", scale_granularity="page",
                               page_size=16) == 2 * 32 * 8 * (1000 * 128 + 63 * 4)
    with pytest.raises(ValueError, match="page_size"):
        accounting.kv_bytes(spec, 1000, kv_cache_dtype="int8", scale_granularity="page")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        accounting.ModelSpec(32, 8, 128, kv_cache_dtype="int3")  # int4 / int2: tests/test_kivi.py


def test_a_byte_budget_affords_about_twice_the_int8_pages():
    budget = 1 << 30
    pages = {(name, g): accounting.ModelSpec(32, 8, 128, "bfloat16", kv_cache_dtype=name,
                                             scale_granularity=g).blocks_for_bytes(budget, 16)
             for name, g in (("auto", "token"), ("int8", "token"), ("int8", "page"))}
    # bf16: 2 * 32 layers * 8 heads * 128 * 2 bytes * 16 tokens = 2 MiB a page.
    assert pages["auto", "token"] == 512
    # Exactly the formula: 2x less the scale bytes (4 per 128 value bytes with token scales).
    assert pages["int8", "token"] == budget // (2 * 32 * 8 * 16 * (128 + 4)) == 992
    assert pages["int8", "page"] == budget // (2 * 32 * 8 * (16 * 128 + 4)) == 1022


def test_the_ledger_counts_scales_once_and_sums_to_the_pool():
    spec = accounting.ModelSpec(L, HKV, D, "float32", kv_cache_dtype="int8",
                                scale_granularity="token")
    ledger = accounting.MemoryLedger.from_blocks(spec, 8, 6, used=[(1, 5), (2, 8)], cached_free=1,
                                                 free=2)
    cats = ledger.categories()
    assert cats["scales"] == 6 * spec.scale_bytes_per_block(8)
    assert sum(cats.values()) == ledger.pool_bytes == 6 * spec.bytes_per_block(8)
    assert cats["effective_kv"] == 5 * spec.bytes_per_token
    res = accounting.MemoryLedger.for_reservation(spec, 32, [10], num_slots=2)
    assert res.categories()["scales"] == 2 * spec.scale_bytes_per_block(32)


def test_the_formula_constants_match_the_quantized_formats():
    for name, size in accounting.QUANT_ITEMSIZE.items():
        assert quant.storage_dtype(name).itemsize == size
    assert accounting.SCALE_BYTES == quant.SCALE_DTYPE(0).dtype.itemsize
