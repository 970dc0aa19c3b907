"""int4 / int2 KIVI pages (pallas_kernels/packed.py, pallas_kernels/kivi.py): packing, decode
attention over closed packed pages plus the open page against the float64 oracle, the no-cache
quantize-on-fill reference, pages moved by CoW / swap / host tier / hand-over, exact bytes, and
settings refused at construction."""

import jax.numpy as jnp
import numpy as np
import pytest
from jit_utils import jit_call
from tolerances import tol

from paged.accounting.formulas import ModelSpec, kv_bytes
from paged.kv import cache as kvc
from pallas_kernels import kivi, packed

D = 16
PPS = 3  # pages per sequence


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_unpack_round_trip_exact(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, (3, 5, 32)).astype(np.uint8)
    values = np.asarray(jit_call(packed.pack, codes, bits=bits))
    assert values.shape == (3, 5, 32 * bits // 8) and values.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(jit_call(packed.unpack, values, bits=bits)), codes)
    np.testing.assert_array_equal(kivi.unpack_np(values, bits), codes)  # independent numpy unpack
    # low bits first: channel 0 of the first byte
    np.testing.assert_array_equal(values[..., 0] & ((1 << bits) - 1), codes[..., 0])


@pytest.mark.parametrize("bits,per", [(4, "channel"), (4, "token"), (2, "channel"), (2, "token")])
def test_quantize_error_within_half_a_step(bits, per):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 8, D)).astype(np.float32) * 3
    x[0, 0, :, 1] = 0.7  # a constant channel
    pages = jit_call(packed.quantize_pages, x, bits=bits, per=per)
    width = D if per == "channel" else 8
    assert pages.scale.shape == (2, 3, width) and pages.scale.dtype == jnp.float16
    deq = np.asarray(jit_call(packed.dequantize, pages))
    err = np.abs(deq - x)
    step = np.asarray(pages.scale, np.float32)
    step = step[..., None, :] if per == "channel" else step[..., None]
    # half a step, plus float16 rounding of the zero point and of the scale
    assert np.all(err <= step * 0.5 + 2e-3 * (np.abs(x) + step * (1 << bits)))
    if per == "channel":
        assert np.abs(deq[0, 0, :, 1] - 0.7).max() < 1e-3


def _case(rng, bits, page, hq, hkv, batch=3, num_pages=10):
    """Packed pools with NaN scales on every page no sequence reads and NaN past each open page's
    tokens; lengths cover an empty sequence, a page boundary and a partial open page."""
    kf = rng.normal(size=(hkv, num_pages, page, D)).astype(np.float32)
    vf = rng.normal(size=(hkv, num_pages, page, D)).astype(np.float32)
    kp = jit_call(packed.quantize_pages, kf, bits=bits, per="channel")
    vp = jit_call(packed.quantize_pages, vf, bits=bits, per="token")
    lengths = np.array([0, 2 * page, 2 * page + page // 2 + 1][:batch], np.int32)
    table = np.zeros((batch, PPS), np.int32)
    table[1, :2] = [3, 7]
    table[2, :2] = [5, 2]
    used = sorted({3, 7, 5, 2})
    unused = [p for p in range(num_pages) if p not in used]

    def poison(p):
        scale = np.array(p.scale)
        scale[:, unused] = np.nan
        return packed.PackedPages(p.values, jnp.asarray(scale), p.zero, p.bits, p.per)

    open_k = rng.normal(size=(batch, hkv, page, D)).astype(np.float32)
    open_v = rng.normal(size=(batch, hkv, page, D)).astype(np.float32)
    for b, n in enumerate(lengths):
        open_k[b, :, n % page:] = np.nan
        open_v[b, :, n % page:] = np.nan
    q = rng.normal(size=(batch, hq, D)).astype(np.float32)
    return q, poison(kp), poison(vp), open_k, open_v, lengths, table


@pytest.mark.parametrize("impl", ["reference", "xla", "interpret_gpu", "interpret_tpu"])
@pytest.mark.parametrize("bits,page,hq,hkv", [(4, 8, 4, 2), (2, 8, 2, 2), (4, 16, 2, 2),
                                              (2, 16, 4, 1)])
def test_decode_matches_float64_oracle(impl, bits, page, hq, hkv):
    rng = np.random.default_rng(page + hq)
    q, kp, vp, ok, ov, lengths, table = _case(rng, bits, page, hq, hkv)
    want = kivi.attention_np(q, kp, vp, ok, ov, lengths, table, sm_scale=D**-0.5, soft_cap=5.0)
    got = jit_call(kivi.paged_attention, q, kp, vp, ok, ov, lengths, table, sm_scale=D**-0.5,
                   soft_cap=5.0, impl=impl, block_tokens=page)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), want, **tol("float32"))
    np.testing.assert_array_equal(np.asarray(got)[0], 0.0)  # an empty sequence reads nothing


@pytest.mark.parametrize("bits,page,hq,hkv", [(4, 8, 4, 2), (2, 8, 2, 2), (4, 16, 2, 2),
                                              (2, 16, 4, 1)])
def test_ragged_rows_match_float64_oracle(bits, page, hq, hkv):
    # Token rows of three sequences, ragged: a prefill chunk whose rows cross a page boundary, a
    # decode row with an empty open page, two rows that read no closed page, and padding rows;
    # unused pages and every open offset past a row's length are NaN. The TPU-style ragged
    # kernel (row tiles of 4: tiles straddle sequences) equals the float64 oracle per row.
    rng = np.random.default_rng(bits * page + hq)
    tables = np.zeros((4, PPS), np.int32)  # sequence 3 has no rows
    tables[0, :3], tables[1, :2], tables[2, :1] = [3, 7, 5], [2, 6], [8]
    unused = [p for p in range(10) if p not in (3, 7, 5, 2, 6, 8)]

    def pool(per):
        p = jit_call(packed.quantize_pages,
                     rng.normal(size=(hkv, 10, page, D)).astype(np.float32), bits=bits, per=per)
        scale = np.array(p.scale)
        scale[:, unused] = np.nan
        return packed.PackedPages(p.values, jnp.asarray(scale), p.zero, p.bits, p.per)

    kp, vp = pool("channel"), pool("token")
    row_len = [2 * page - 2, 2 * page - 1, 2 * page, 2 * page + 1, 3 * page - 1,  # sequence 0
               2 * page,  # 1: a decode right after its page closed
               2, 3, 0, 0]  # 2: no closed page yet; padding
    row_seq = [0, 0, 0, 0, 0, 1, 2, 2, 0, 0]
    cu = np.array([0, 5, 6, 8, 8], np.int32)
    t = len(row_len)
    q = rng.normal(size=(t, hq, D)).astype(np.float32)
    ok, ov = (rng.normal(size=(t, hkv, page, D)).astype(np.float32) for _ in range(2))
    for r, n in enumerate(row_len):
        ok[r, :, n % page:] = ov[r, :, n % page:] = np.nan
    per_row = tables[row_seq]
    want = kivi.attention_np(q, kp, vp, ok, ov, np.array(row_len), per_row, sm_scale=D**-0.5,
                             soft_cap=5.0)
    args = (jnp.asarray(ok), jnp.asarray(ov), jnp.asarray(row_len, jnp.int32),
            jnp.asarray(row_seq, jnp.int32), jnp.asarray(tables), jnp.asarray(cu))
    got = jit_call(kivi.ragged_paged_attention, q, kp, vp, *args, sm_scale=D**-0.5,
                   soft_cap=5.0, impl="interpret_tpu", block_rows=4)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), want, **tol("float32"))
    np.testing.assert_array_equal(np.asarray(got)[8:], 0.0)  # padding rows read nothing
    xla = jit_call(kivi.ragged_paged_attention, q, kp, vp, *args, sm_scale=D**-0.5,
                   soft_cap=5.0, impl="xla")
    np.testing.assert_allclose(np.asarray(xla), want, **tol("float32"))


def test_decode_reads_a_stacked_layer():
    rng = np.random.default_rng(1)
    q, kp, vp, ok, ov, lengths, table = _case(rng, 4, 8, 4, 2)
    stack = [packed.PackedPages(*(jnp.stack([x * 0, x]) for x in (p.values, p.scale, p.zero)),
                                p.bits, p.per) for p in (kp, vp)]
    args = (jnp.asarray(ok), jnp.asarray(ov), jnp.asarray(lengths), jnp.asarray(table))
    want = jit_call(kivi.paged_attention, q, kp, vp, *args, sm_scale=0.3)
    got = jit_call(kivi.paged_attention, q, *stack, *args, sm_scale=0.3, layer=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["pallas", "bogus"])
def test_unknown_impls_refused(impl):
    rng = np.random.default_rng(2)
    q, kp, vp, ok, ov, lengths, table = _case(rng, 4, 8, 2, 2)
    with pytest.raises(ValueError, match="impl="):
        kivi.paged_attention(jnp.asarray(q), kp, vp, jnp.asarray(ok), jnp.asarray(ov),
                             jnp.asarray(lengths), jnp.asarray(table), impl=impl)


@pytest.mark.parametrize("bits,page,hq,hkv", [(4, 8, 4, 2), (2, 16, 2, 2)])
def test_paged_decode_equals_dense_on_fill_reference(bits, page, hq, hkv):
    """The paged cache's semantics (pages quantized when full, the open page exact) equal the
    no-cache reference `kivi.dense_on_fill` at every decode position."""
    rng = np.random.default_rng(bits * page)
    t = 2 * page + 3
    q = rng.normal(size=(1, t, hq, D)).astype(np.float32)
    k = rng.normal(size=(1, t, hkv, D)).astype(np.float32)
    v = rng.normal(size=(1, t, hkv, D)).astype(np.float32)
    dense = np.asarray(jit_call(kivi.dense_on_fill, q, k, v, bits=bits, page_size=page,
                                sm_scale=0.25))
    pool = np.zeros((2, hkv, PPS + 1, page, D), np.float32)  # [K/V, Hkv, P, page, D]; page 0 null
    for p in range(PPS):
        for i, x in enumerate((k, v)):
            chunk = x[0, p * page:(p + 1) * page]
            pool[i, :, p + 1, :len(chunk)] = np.moveaxis(chunk, 0, 1)
    kp = jit_call(packed.quantize_pages, pool[0], bits=bits, per="channel")
    vp = jit_call(packed.quantize_pages, pool[1], bits=bits, per="token")
    table = np.arange(1, PPS + 1, dtype=np.int32)[None]
    for pos in (page - 2, page - 1, page, t - 1):  # before, at and after a page fills
        n = pos + 1
        start = (n // page) * page
        open_k = np.zeros((1, hkv, page, D), np.float32)
        open_v = np.zeros((1, hkv, page, D), np.float32)
        open_k[0, :, :n - start] = np.moveaxis(k[0, start:n], 0, 1)
        open_v[0, :, :n - start] = np.moveaxis(v[0, start:n], 0, 1)
        got = jit_call(kivi.paged_attention, q[:, pos], kp, vp, open_k, open_v,
                       np.array([n], np.int32), table, sm_scale=0.25)
        np.testing.assert_allclose(np.asarray(got)[0], dense[0, pos], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["int4", "int2"])
def test_packed_pages_survive_cow_swap_tier_and_handover(dtype):
    rng = np.random.default_rng(3)
    cache = kvc.KVCache.create(2, 2, 8, 8, D, kv_cache_dtype=dtype)
    full = rng.normal(size=(2, 2, 3, 8, D)).astype(np.float32)
    ids = np.array([1, 2, 3], np.int32)
    cache = cache.replace(k_pages=jit_call(packed.close_pages, cache.k_pages, full, ids),
                          v_pages=jit_call(packed.close_pages, cache.v_pages, full * 2, ids))
    want_k, want_v = kvc.swap_out(cache, [1, 2, 3])
    cache = kvc.copy_pages(cache, [1], [4])  # copy-on-write
    # swap / host tier: out to host slots, back into other pages (a preempted, swapped sequence)
    host_k, host_v = kvc.host_buffers(cache, 4)
    kvc.host_set(host_k, [0, 1, 2], want_k)
    kvc.host_set(host_v, [0, 1, 2], want_v)
    cache = kvc.swap_in(cache, [5, 6, 7], kvc.host_get(host_k, [0, 1, 2]),
                        kvc.host_get(host_v, [0, 1, 2]))
    k_moved, v_moved = kvc.swap_out(cache, [4, 5, 6, 7])
    for got, want in ((k_moved, want_k), (v_moved, want_v)):
        for leaf in ("values", "scale", "zero"):
            g, w = np.asarray(getattr(got, leaf)), np.asarray(getattr(want, leaf))
            np.testing.assert_array_equal(g[:, :, 0], w[:, :, 0])  # CoW
            np.testing.assert_array_equal(g[:, :, 1:], w)  # swap in
    # hand-over: gather from one cache, scatter into another
    other = kvc.KVCache.create(2, 2, 8, 8, D, kv_cache_dtype=dtype)
    other = kvc.scatter_pages(other, [3, 4, 6], *kvc.gather_pages(cache, [1, 2, 3]))
    k_other, _ = kvc.swap_out(other, [3, 4, 6])
    np.testing.assert_array_equal(np.asarray(k_other.values), np.asarray(want_k.values))
    k_seq, _ = kvc.gather(cache, [5, 6], 16)
    fq = np.asarray(jit_call(packed.fake_quantize_page, full[:, :, :2],
                             bits=packed.bits_of(dtype), per="channel"))
    np.testing.assert_array_equal(k_seq, np.moveaxis(fq, 1, 3).reshape(2, 16, 2, D))


@pytest.mark.parametrize("dtype,bits", [("int4", 4), ("int2", 2)])
@pytest.mark.parametrize("page", [8, 16])
def test_bytes_are_exact(dtype, bits, page):
    layers, hkv, num_pages = 3, 2, 5
    cache = kvc.KVCache.create(layers, hkv, num_pages, page, D, kv_cache_dtype=dtype)
    spec = ModelSpec(layers, hkv, D, "bfloat16", kv_cache_dtype=dtype)
    assert spec.bytes_per_block(page) * num_pages == cache.nbytes
    assert spec.scale_bytes_per_block(page) * num_pages == cache.scale_nbytes
    assert spec.value_bytes_per_block(page) == 2 * layers * hkv * page * D * bits // 8
    # a bfloat16 page less the packed value bytes (the open page's head lives in its pool page)
    assert spec.open_page_bytes(page) == 2 * layers * hkv * page * D * (2 - bits / 8)
    with_slots = kvc.KVCache.create(layers, hkv, num_pages, page, D, jnp.bfloat16,
                                    kv_cache_dtype=dtype, open_slots=3)
    assert with_slots.open_nbytes == 3 * spec.open_page_bytes(page)
    n = 2 * page + 1
    assert kv_bytes(spec, n, page_size=page) == 3 * spec.bytes_per_block(page)
    assert spec.sequence_bytes(n, page) == 3 * spec.bytes_per_block(page) + spec.open_page_bytes(page)
    assert spec.sequence_bytes(n, page, running=False) == kv_bytes(spec, n, page_size=page)
    bf16 = ModelSpec(layers, hkv, D, "bfloat16")
    assert bf16.open_page_bytes(page) == 0
    assert bf16.sequence_bytes(n, page) == 3 * bf16.bytes_per_block(page)
    assert spec.sequences_for_bytes(10 * spec.sequence_bytes(n, page), n, page) == 10


def test_issue_arithmetic_at_page_64():
    """KIVI's goal arithmetic (issue #42) from the formulas: int4 at page 64, D = 128."""
    spec = ModelSpec(1, 1, 128, "bfloat16", kv_cache_dtype="int4")
    # K: 4096 value bytes + 128 channels x (scale + zero) x 2 B; V: 4096 + 64 tokens x 4 B
    assert spec.bytes_per_block(64) == 2 * 4096 + 128 * 4 + 64 * 4
    with pytest.raises(ValueError, match="bytes per block"):
        spec.bytes_per_token  # noqa: B018


@pytest.mark.parametrize("dtype,head_dim,page,match", [
    ("int4", 15, 8, "multiple of 2"),
    ("int2", 18, 8, "multiple of 4"),
    ("int4", 16, 1, "block_size=1"),
])
def test_bad_cache_settings_refused(dtype, head_dim, page, match):
    with pytest.raises(ValueError, match=match):
        kvc.KVCache.create(1, 1, 4, page, head_dim, kv_cache_dtype=dtype)


def test_packed_pages_are_not_written_token_by_token():
    cache = kvc.KVCache.create(1, 1, 4, 8, D, kv_cache_dtype="int4")
    x = jnp.zeros((1, 1, 1, D))
    with pytest.raises(TypeError, match="close_pages"):
        kvc.write(cache, x, x, jnp.array([9]))


def test_capacity_study_rows():
    """experiments/kivi_capacity.py's rows: the issue's goal arithmetic at page 64 (Llama-3-8B)."""
    from experiments import kivi_capacity
    from experiments.configs.kivi_capacity import get_config

    c = get_config("smoke")
    assert kivi_capacity.check(c)["specs"]
    spec = ModelSpec(32, 8, 128, "bfloat16", kv_cache_dtype="int4")
    r = kivi_capacity.row(spec, 64, 1000, 1 << 34)
    assert r["sequence_bytes"] == 16 * spec.bytes_per_block(64) + spec.open_page_bytes(64)
    assert r["open_page_without_pool_page"]["sequence_bytes"] == \
        15 * spec.bytes_per_block(64) + 2 * 32 * 8 * 64 * 128 * 2  # + a bfloat16 page
    # the open page's head in its pool page's value bytes: closed pages, one bfloat16 page and
    # one page's scales (the issue's ~3.13x arithmetic less one page of scales: 3.12x)
    assert r["sequence_bytes"] == 15 * spec.bytes_per_block(64) + 2 * 32 * 8 * 64 * 128 * 2 \
        + spec.scale_bytes_per_block(64)
    assert r["tokens_held"] / kivi_capacity.row(ModelSpec(32, 8, 128, "bfloat16"), 64, 1000,
                                                 1 << 34)["tokens_held"] > 3.1


def test_dense_model_reference_with_kivi_pages():
    """`Llama.dense(kv_quant=("int4", "kivi", page))`: exact while no page is full (one page
    longer than the sequence), and changed once pages fill."""
    import jax
    from engine_utils import small_model

    from paged.models.llama import Llama

    cfg, params = small_model()
    tokens = jax.numpy.asarray([[256, 5, 9, 77, 3, 120, 42, 8, 19, 200, 7]], jax.numpy.int32)
    dense = jax.jit(lambda p, t, kvq: Llama(cfg).apply(p, t, method="dense", kv_quant=kvq),
                    static_argnums=2)  # one compile per kv_quant, not one per eager operation
    fn = lambda kvq: np.asarray(dense(params, tokens, kvq))
    exact = fn(None)
    np.testing.assert_allclose(fn(("int4", "kivi", 16)), exact, rtol=2e-5, atol=2e-4)
    quantized = fn(("int2", "kivi", 4))
    assert np.all(np.isfinite(quantized)) and not np.allclose(quantized, exact, atol=1e-3)
    # positions before the first page fills (0..2 of pages of 4) read only their open page: exact
    np.testing.assert_allclose(quantized[:, :3], exact[:, :3], rtol=2e-5, atol=2e-4)


def test_quality_parses_kivi_arms():
    from experiments import quality

    arm = quality.parse_arm("int4:kivi")
    assert (arm.kv_cache_dtype, arm.granularity) == ("int4", "kivi")
    with pytest.raises(ValueError):
        quality.parse_arm("int4:token")


def test_general_paged_attention_refuses_packed_pages():
    import pallas_kernels as pk

    rng = np.random.default_rng(4)
    q, kp, vp, _, _, lengths, table = _case(rng, 4, 8, 2, 2)
    with pytest.raises(ValueError, match="kivi"):
        pk.paged_attention(jnp.asarray(q), kp, vp, jnp.asarray(lengths), jnp.asarray(table))
