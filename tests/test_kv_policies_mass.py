"""Attention mass for KV policies (H2O, SnapKV, PyramidKV; docs/kv-policies.md): the XLA path and
the reference return each (sequence, KV head, slot)'s attention mass, equal to a float64 numpy
computation; per-layer holes hide exactly their slots; the default call is unchanged; the
policies' scores and PyramidKV's budgets on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest
from jit_utils import jit_call

import pallas_kernels as pk
from paged.config.kv_policy import KVPolicyConfig
from paged.kv import policies
from paged.kv.policies.pyramidkv import layer_budgets
from paged.kv.policies.snapkv import pool

HKV, G, D, B = 2, 3, 8, 4
SCALE = 0.35


def _batch(seed=0, soft_cap=None):
    """A ragged batch: a 3-token chunk, a decode, a 6-token chunk (prefill), a padding slot."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(HKV, 12, B, D)).astype(np.float32)
    v = rng.normal(size=(HKV, 12, B, D)).astype(np.float32)
    kv_lens = np.array([9, 5, 13, 0], np.int32)
    q_lens = np.array([3, 1, 6, 0])
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tables = np.array([[1, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 10], [0, 0, 0, 0]], np.int32)
    q = rng.normal(size=(16, HKV * G, D)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, size=16).astype(np.float32)
    return q, k, v, kv_lens, q_lens, cu, tables, w


def _mass64(q, k, kv_lens, q_lens, cu, tables, w, holes=None):
    """float64 numpy: per sequence, KV head, slot: sum over its rows and the group's heads of
    weight x softmax probability."""
    out = np.zeros((len(kv_lens), HKV, tables.shape[1] * B))
    for s in range(len(kv_lens)):
        keys = k[:, tables[s]].reshape(HKV, -1, D).astype(np.float64)
        for i in range(q_lens[s]):
            t, pos = cu[s] + i, kv_lens[s] - q_lens[s] + i
            seen = np.arange(pos + 1)
            if holes is not None:
                seen = seen[(seen < holes[s, 0]) | (seen >= holes[s, 1])]
            for h in range(HKV):
                for g in range(G):
                    x = keys[h, seen] @ q[t, h * G + g].astype(np.float64) * SCALE
                    p = np.exp(x - x.max())
                    out[s, h, seen] += w[t] * p / p.sum()
    return out


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_ragged_mass_equals_float64(impl):
    q, k, v, kv_lens, q_lens, cu, tables, w = _batch()
    args = (q, k, v, kv_lens, tables, cu, np.array([3], np.int32))
    out, mass = jit_call(pk.ragged_paged_attention, *args, sm_scale=SCALE, impl=impl,
                         mass_weight=w)
    np.testing.assert_allclose(mass, _mass64(q, k, kv_lens, q_lens, cu, tables, w), atol=2e-6)
    # The default call is unchanged: the same output, and no mass.
    plain = jit_call(pk.ragged_paged_attention, *args, sm_scale=SCALE, impl=impl)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
    # Every query's probabilities sum to 1: a sequence's mass is its rows' weights x Hq.
    np.testing.assert_allclose(np.asarray(mass).sum(axis=(1, 2))[:3],
                               [HKV * G * w[cu[s]:cu[s + 1]].sum() for s in range(3)], rtol=1e-5)


def test_mass_from_the_stacked_cache_and_in_blocks_of_one_page():
    """``layer=`` (the engine's stacked cache) and key blocks of one page (several loop trips)
    give the same mass; NaN in unseen slots (a poisoned page) never reaches it."""
    q, k, v, kv_lens, q_lens, cu, tables, w = _batch(seed=1)
    k[:, 4, 3] = np.nan  # slot 15 of sequence 0: past its 9 keys
    stacked = np.stack([np.zeros_like(k), k]), np.stack([np.zeros_like(v), v])
    out, mass = jit_call(
        pk.ragged_paged_attention, q, *stacked, kv_lens, tables, cu, np.array([3], np.int32),
        sm_scale=SCALE, impl="xla", layer=1, mass_weight=w,
        config=pk.XlaConfig(block_tokens=B, items_per_group=1))
    np.testing.assert_allclose(mass, _mass64(q, k, kv_lens, q_lens, cu, tables, w), atol=2e-6)
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_decode_mass_equals_float64(impl):
    q, k, v, kv_lens, _, _, tables, w = _batch(seed=2)
    lens = np.array([9, 5, 13, 1], np.int32)
    out, mass = jit_call(pk.paged_attention, q[:4], k, v, lens, tables, sm_scale=SCALE,
                         impl=impl, mass_weight=w[:4])
    ones, cu = np.ones(4, int), np.arange(5)
    np.testing.assert_allclose(mass, _mass64(q[:4], k, lens, ones, cu, tables, w[:4]),
                               atol=2e-6)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_holes_hide_exactly_their_slots(impl):
    """``kv_holes`` (PyramidKV's per-layer budgets): the output equals attention over the seen
    slots only (a float64 softmax), and their mass is 0."""
    q, k, v, kv_lens, q_lens, cu, tables, w = _batch(seed=3)
    holes = np.array([[2, 5], [1, 1], [4, 9], [0, 0]], np.int32)
    out, mass = jit_call(
        pk.ragged_paged_attention, q, k, v, kv_lens, tables, cu, np.array([3], np.int32),
        sm_scale=SCALE, impl=impl, mass_weight=w, kv_holes=holes)
    np.testing.assert_allclose(mass, _mass64(q, k, kv_lens, q_lens, cu, tables, w, holes),
                               atol=2e-6)
    s, i = 2, 5  # the chunk's last row: position 12, sees 0..3 and 9..12
    t = cu[s] + i
    keys = k[:, tables[s]].reshape(HKV, -1, D)[:, [0, 1, 2, 3, 9, 10, 11, 12]]
    vals = v[:, tables[s]].reshape(HKV, -1, D)[:, [0, 1, 2, 3, 9, 10, 11, 12]]
    for h in range(HKV):
        x = keys[h].astype(np.float64) @ q[t, h * G].astype(np.float64) * SCALE
        p = np.exp(x - x.max())
        np.testing.assert_allclose(np.asarray(out)[t, h * G], p @ vals[h] / p.sum(), atol=1e-5)


def test_the_pallas_kernels_refuse_the_mass_with_a_clear_error():
    q, k, v, kv_lens, _, cu, tables, w = _batch()
    with pytest.raises(ValueError, match="mass_weight"):
        pk.ragged_paged_attention(q, k, v, kv_lens, tables, cu, np.array([3], np.int32),
                                  impl="interpret_tpu", mass_weight=w)
    with pytest.raises(ValueError, match="mass_weight"):
        pk.ragged_paged_attention(q, k, v, kv_lens, tables, cu, np.array([3], np.int32),
                                  impl="xla", mass_weight=w[:3])


def _scores(pol, mass, n=10):
    keys = np.zeros((1, 1, n, 4), np.float32)
    pos = np.arange(n)[None, None]
    return policies.build(pol).scores(np, keys, pos, np.ones(n, bool), mass=mass[None, None])


def test_h2o_keeps_the_heaviest_and_the_recent():
    mass = np.array([5.0, 0.1, 3.0, 0.2, 0.3, 4.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    s = _scores(KVPolicyConfig("h2o", budget=6, recent_tokens=3), mass)[0, 0]
    top = np.argsort(-s, kind="stable")[:6]
    assert sorted(top.tolist()) == [0, 2, 5, 7, 8, 9]  # recent 7..9, then mass 5, 4, 3
    # By default half the kept count is recent: budget 0.6 of 10 tokens keeps 6, 3 recent.
    s = _scores(KVPolicyConfig("h2o", budget=0.6), mass)[0, 0]
    assert sorted(np.argsort(-s, kind="stable")[:6].tolist()) == [0, 2, 5, 7, 8, 9]
    s = _scores(KVPolicyConfig("h2o", budget=8, recent_tokens=0.25), mass)[0, 0]
    assert sorted(np.argsort(-s, kind="stable")[:8].tolist()) == [0, 1, 2, 3, 4, 5, 8, 9]


def test_snapkv_pools_the_votes_and_keeps_the_window():
    """Window 3 (slots 7..9, forced), votes outside it pooled over 3 slots: avg spreads slot 2's
    vote to 1 and 3; max takes each neighbour's largest."""
    mass = np.array([0.0, 0.0, 9.0, 0.0, 0.0, 3.0, 3.0, 50.0, 50.0, 50.0], np.float32)
    avg = _scores(KVPolicyConfig("snapkv", budget=5, window=3, kernel=3), mass)[0, 0]
    # The window's votes are left out of the pooling: slot 6 sees 3 + 3 (+ 0 for slot 7).
    np.testing.assert_allclose(avg[:7], [0, 3, 3, 3, 1, 2, 2])
    assert (avg[7:] > 1e9).all()
    mx = _scores(KVPolicyConfig("snapkv", budget=5, window=3, kernel=3, pooling="max"), mass)
    np.testing.assert_allclose(mx[0, 0, :7], [0, 9, 9, 9, 3, 3, 3])
    np.testing.assert_allclose(pool(np, np.arange(5.0), 5, "avg"), [0.6, 1.2, 2.0, 2.0, 1.8])


def test_pyramid_budgets_follow_kvpress():
    """The first layer keeps 2k - k/beta, the last k/beta, a line between, average k; a line
    leaving [window, n] falls back to SnapKV's uniform budget."""
    assert layer_budgets(12, 30, 2, 2, 2.0) == [18, 6]
    assert layer_budgets(40, 1000, 5, 4, 4.0) == [70, 55, 40, 25, 10]
    assert layer_budgets(40, 1000, 5, 16, 4.0) == [40] * 5  # 10 < window
    assert layer_budgets(40, 60, 3, 4, 4.0) == [56, 40, 24]  # first capped at n - window
    assert layer_budgets(7, 20, 1, 2, 2.0) == [7]
    pol = policies.build(KVPolicyConfig("pyramidkv", budget=0.5, window=2, beta=2.0))
    assert pol.layer_keep(24, 2) == [18, 6] and pol.per_layer
    # Every other method keeps its one count in every layer.
    assert policies.build(KVPolicyConfig("h2o", budget=5)).layer_keep(30, 3) == [5, 5, 5]


def test_stacked_layers_accumulate_the_same_mass():
    """A model whose layers run as one scan (stacked params, as the packaged GGUF models load)
    sows its mass per layer from the scan and reads its holes by the traced layer index:
    PyramidKV (mass and holes) gives the tokens and log-probs of the per-layer model."""
    import jax
    from engine_utils import prompts, small_model

    from paged import Engine, EngineConfig, SamplingParams
    from paged.models.scan_layers import stack_layers

    cfg, params = small_model()
    stacked = stack_layers(cfg, jax.tree.map(np.asarray, params))
    ps = prompts(2, seed=9, min_len=18, max_len=30)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    pol = KVPolicyConfig("pyramidkv", budget=10, window=2, kernel=3, beta=2.0)
    outs, stats = [], []
    for p in (params, stacked):
        engine = Engine(EngineConfig(block_size=4, max_num_seqs=2, max_model_len=64,
                                     max_num_batched_tokens=32, kv_policy=pol),
                        model_config=cfg, params=p)
        outs.append(engine.generate(ps, sp))
        stats.append(engine.kv_stats()["kv_policy"])
    assert stats[0] == stats[1] and stats[0]["slots_hidden"] > 0
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose([next(iter(d.values())) for d in a.outputs[0].logprobs],
                                   [next(iter(d.values())) for d in b.outputs[0].logprobs],
                                   atol=1e-4)
