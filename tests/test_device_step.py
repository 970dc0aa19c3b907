"""The jitted engine forward updates the donated cache in place and never copies a layer of it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_utils import small_model
from jit_utils import jit_call

import pallas_kernels as pk
from paged.engine.device_step import make_forward, make_step_fn, sample_trace_count
from paged.kv import cache as kc
from paged.request.sampling import MAX_LOGPROBS
from paged.step.batch import BatchBuilder
from paged.step.input_batch import InputBatch

NUM_PAGES = 777  # a size no other array in the step has


def test_step_never_materializes_a_layer_of_the_pool():
    cfg, params = small_model()
    step, _ = make_forward(cfg, "xla")  # the step's half that touches the pool
    cache = kc.KVCache.create(cfg.num_layers, cfg.num_kv_heads, NUM_PAGES, 8, cfg.head_dim)
    batch = BatchBuilder(InputBatch(32, 4, -1), None, 8).empty(16, 4, 4)
    prev = np.zeros(4, np.int32)
    hlo = step.lower(jax.device_put(params), cache, batch, prev).compile().as_text()
    layer_shape = f"[{cfg.num_kv_heads},{NUM_PAGES},8,{cfg.head_dim}]"
    offenders = [line.strip()[:120] for line in hlo.splitlines() if layer_shape in line]
    assert not offenders, f"a per-layer copy of the pool appears in the step:\n{offenders[:3]}"


def test_the_sampler_compiles_per_sample_slots_not_per_step_shape():
    """The step is two jitted calls: a new step shape compiles the forward alone when its sample
    slots were sampled before, and the log-probability step reuses the plain step's forward."""
    cfg, params = small_model()
    plain, _ = make_step_fn(cfg, "xla", 4)
    logprobs, _ = make_step_fn(cfg, "xla", 4, with_logprobs=True)
    _, forward_traces = make_forward(cfg, "xla")
    params = jax.device_put(params)
    cache = kc.KVCache.create(cfg.num_layers, cfg.num_kv_heads, NUM_PAGES + 2, 8, cfg.head_dim)
    builder, prev = BatchBuilder(InputBatch(32, 4, -1), None, 8), np.zeros(4, np.int32)
    cache, tokens = plain(params, cache, builder.empty(8, 4, 4), prev)  # a pool no one else has
    counts = lambda: (forward_traces(), sample_trace_count())
    before = counts()
    cache, tokens, extras = logprobs(params, cache, builder.empty(8, 4, 4), tokens)
    assert counts()[0] == before[0]  # the same forward
    before = counts()
    cache, tokens = plain(params, cache, builder.empty(16, 4, 4), tokens)
    assert np.subtract(counts(), before).tolist() == [1, 0]  # a new forward shape, no sampler
    assert tokens.shape == (4,) and extras["logprobs"][1].shape == (4, MAX_LOGPROBS)


def test_verify_steps_pad_to_one_sample_slot_count_per_bucket_pair():
    builder = BatchBuilder(InputBatch(32, 4, -1), None, 8)
    builder.verify_slots = 4  # k = 3
    assert {builder.buckets(32, 4, n, verify=True) for n in range(1, 17)} == {(32, 4, 16)}
    assert builder.buckets(8, 4, 5, verify=True) == (8, 4, 8)  # at most the token bucket
    assert builder.buckets(32, 4, 20, verify=True) == (32, 4, 32)  # more slots: their bucket
    assert builder.buckets(32, 4, 5) == (32, 4, 8)  # steps without verify rows: unchanged


@pytest.mark.parametrize("op", ["paged", "ragged"])
def test_stacked_layer_read_equals_slice(op):
    rng = np.random.default_rng(0)
    L, hkv, p, page, d = 3, 2, 9, 8, 16
    k = rng.standard_normal((L, hkv, p, page, d)).astype(np.float32)
    v = rng.standard_normal((L, hkv, p, page, d)).astype(np.float32)
    table = np.array([[1, 4, 0], [2, 3, 5]], np.int32)
    lens = np.array([11, 20], np.int32)
    if op == "paged":
        q = rng.standard_normal((2, 4, d)).astype(np.float32)
        call = lambda kp, vp, **kw: pk.paged_attention(q, kp, vp, lens, table, impl="xla", **kw)
        jitted = lambda kp, vp, **kw: jit_call(pk.paged_attention, q, kp, vp, lens, table,
                                               impl="xla", **kw)
    else:
        q = rng.standard_normal((5, 4, d)).astype(np.float32)
        cu = np.array([0, 3, 5], np.int32)
        call = lambda kp, vp, **kw: pk.ragged_paged_attention(q, kp, vp, lens, table, cu, 2,
                                                              impl="xla", **kw)
        jitted = lambda kp, vp, **kw: jit_call(pk.ragged_paged_attention, q, kp, vp, lens, table,
                                               cu, num_seqs=2, impl="xla", **kw)
    for layer in range(L):  # jitted: one compile per layer, not one per eager operation
        np.testing.assert_array_equal(np.asarray(jitted(k, v, layer=layer)),
                                      np.asarray(jitted(k[layer], v[layer])))
    with pytest.raises(ValueError, match="layer=3"):
        call(k, v, layer=3)
    with pytest.raises(ValueError, match="stacked cache"):
        call(k[0], v[0], layer=0)


def test_all_greedy_batches_take_the_argmax_path_with_the_same_results():
    """The greedy fast paths of ``sample`` and ``verify`` equal the general rule row by row."""
    from paged.engine import sampler as sampling

    rng = np.random.default_rng(0)
    n, vocab = 12, 50
    logits = rng.normal(size=(n, vocab)).astype(np.float32) * 3
    zeros_f, zeros_i = np.zeros(n, np.float32), np.zeros(n, np.int32)
    args = (logits, zeros_f, zeros_i, np.ones(n, np.float32), zeros_i + 7, zeros_i,
            np.arange(n, dtype=np.int32))
    top = logits.argmax(-1)
    draft = np.where(np.arange(n) % 3 == 0, top, (top + 1) % vocab).astype(np.int32)
    draft[1] = -1  # no proposal
    general_sample = jax.jit(jax.vmap(sampling._sample_one))(*args)
    np.testing.assert_array_equal(jax.jit(sampling.sample)(*args), general_sample)
    np.testing.assert_array_equal(general_sample, top)
    q = jax.nn.softmax(rng.normal(size=(n, vocab)).astype(np.float32))  # a draft's distribution
    for qs, q_index in ((None, None), (q, np.where(np.arange(n) % 2 == 0, np.arange(n), -1))):
        tokens, accept = jax.jit(sampling.verify)(*args, draft, qs, q_index)
        point = jax.nn.one_hot(np.maximum(draft, 0), vocab)
        full = point if qs is None else np.where((q_index >= 0)[:, None], q, point)
        g_tokens, g_accept = jax.jit(jax.vmap(sampling._verify_one))(*args, draft, full)
        np.testing.assert_array_equal(tokens, g_tokens)
        np.testing.assert_array_equal(accept, g_accept)
        np.testing.assert_array_equal(accept, (draft >= 0) & (draft == top))
