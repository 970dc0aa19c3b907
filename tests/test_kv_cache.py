"""KVCache: writes land where slot_mapping says, CoW/swap/poison/gather, donation is in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.kv import cache as kc

L, HKV, P, PAGE, D = 2, 2, 6, 4, 8


def _cache():
    return kc.KVCache.create(L, HKV, P, PAGE, D)


def _tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((L, n, HKV, D)).astype(np.float32)
    return jnp.asarray(k), jnp.asarray(-k)


def test_write_then_gather_follows_slot_mapping():
    cache = _cache()
    k, v = _tokens(6)
    # Sequence on pages [3, 1]: positions 0..3 -> page 3, 4..5 -> page 1 offsets 0,1.
    slots = np.array([12, 13, 14, 15, 4, 5])
    cache = kc.write(cache, k, v, slots)
    gk, gv = kc.gather(cache, [3, 1], 6)
    np.testing.assert_array_equal(gk, np.asarray(k))
    np.testing.assert_array_equal(gv, np.asarray(v))
    # Untouched pages stay zero.
    assert not np.asarray(cache.k_pages[:, :, 2]).any()


def test_padding_tokens_go_to_null_page_only():
    cache = _cache()
    k, v = _tokens(3)
    cache = kc.write(cache, k, v, np.array([8, kc.NULL_PAGE, kc.NULL_PAGE]))
    kp = np.asarray(cache.k_pages)
    assert kp[:, :, 2, 0].any()
    assert not kp[:, :, 1].any() and not kp[:, :, 3:].any()


def test_copy_pages_is_copy_on_write():
    cache = _cache()
    k, v = _tokens(4)
    cache = kc.write(cache, k, v, np.arange(4, 8))  # page 1
    cache = kc.copy_pages(cache, [1], [4])
    np.testing.assert_array_equal(np.asarray(cache.k_pages[:, :, 4]), np.asarray(cache.k_pages[:, :, 1]))
    # Writing into the copy leaves the source untouched.
    k2, v2 = _tokens(1, seed=1)
    before = np.asarray(cache.k_pages[:, :, 1]).copy()
    cache = kc.write(cache, k2, v2, np.array([4 * PAGE + 3]))
    np.testing.assert_array_equal(np.asarray(cache.k_pages[:, :, 1]), before)


def test_swap_out_and_in_round_trip_to_other_pages():
    cache = _cache()
    k, v = _tokens(8)
    cache = kc.write(cache, k, v, np.arange(4, 12))  # pages 1, 2
    hk, hv = kc.swap_out(cache, [1, 2])
    assert hk.shape == (L, HKV, 2, PAGE, D) and isinstance(hk, np.ndarray)
    cache = kc.poison(cache, [1, 2])
    assert np.isnan(np.asarray(cache.k_pages[:, :, 1])).all()
    cache = kc.swap_in(cache, [5, 3], hk, hv)
    gk, gv = kc.gather(cache, [5, 3], 8)
    np.testing.assert_array_equal(gk, np.asarray(k))
    np.testing.assert_array_equal(gv, np.asarray(v))


def test_donation_updates_in_place():
    cache = _cache()
    k, v = _tokens(2)
    cache = kc.write(cache, k, v, np.array([4, 5]))  # warm up (compile)
    old = cache.k_pages
    ptr = old.unsafe_buffer_pointer()
    new = kc.write(cache, k, v, np.array([6, 7]))
    assert old.is_deleted(), "donated input must be consumed"
    assert new.k_pages.unsafe_buffer_pointer() == ptr, "donation must reuse the buffer, not copy"
    ptr = new.k_pages.unsafe_buffer_pointer()
    new = kc.copy_pages(new, [1], [2])
    assert new.k_pages.unsafe_buffer_pointer() == ptr


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c: kc.write(c, *_tokens(2), np.array([1, 2, 3])), "slot_mapping.shape"),
        (lambda c: kc.write(c, jnp.zeros((L, 2, HKV + 1, D)), jnp.zeros((L, 2, HKV + 1, D)),
                            np.array([1, 2])), "num_kv_heads"),
        (lambda c: kc.copy_pages(c, [1], [P]), "outside"),
        (lambda c: kc.copy_pages(c, [1, 2], [3, 3]), "distinct"),
        (lambda c: kc.copy_pages(c, [1], [3, 4]), "src has 1"),
        (lambda c: kc.gather(c, [1], PAGE + 1), "length="),
        (lambda c: kc.swap_in(c, [1], np.zeros((L, HKV, 2, PAGE, D)), np.zeros((L, HKV, 2, PAGE, D))), "k.shape"),
    ],
)
def test_bad_inputs_raise_before_touching_the_cache(call, match):
    cache = _cache()
    with pytest.raises((ValueError, TypeError), match=match):
        call(cache)
    assert not cache.k_pages.is_deleted()


def test_create_validates_and_can_shard():
    with pytest.raises(ValueError, match="num_pages=1"):
        kc.KVCache.create(1, 1, 1, 4, 8)
    with pytest.raises(ValueError, match="page_size=0"):
        kc.KVCache.create(1, 1, 4, 0, 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    spec = jax.sharding.PartitionSpec(None, "model")
    c = kc.KVCache.create(1, 2, 4, 4, 8, sharding=jax.sharding.NamedSharding(mesh, spec))
    assert c.k_pages.sharding.spec == spec


def test_pad_pages_powers_of_two():
    assert kc.pad_pages(np.array([3, 4, 5])).tolist() == [3, 4, 5, 0]
    assert kc.next_pow2(1) == 1 and kc.next_pow2(5) == 8 and kc.next_pow2(8) == 8
