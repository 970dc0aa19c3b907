"""The decoder: paged serving equals dense recompute; layers against float64 numpy; configs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import tol

from paged.models import (
    AttentionMetadata,
    Llama,
    LlamaConfig,
    PagedAttention,
    build_metadata,
    init_params,
)
from paged.models.attention import causal_attention
from paged.models.layers import RMSNorm, apply_rope

CFG = LlamaConfig(
    vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=96
)
TOL = tol(np.float32)


@functools.cache
def _params():
    return init_params(CFG, seed=0)


@functools.cache
def _dense():
    return jax.jit(lambda p, t: Llama(CFG).apply(p, t, method="dense"))


@functools.cache
def _paged():
    def step(params, k_pages, v_pages, tokens, positions, md, logits_indices):
        return Llama(CFG).apply(
            params, tokens, positions, k_pages, v_pages, md, logits_indices, attention_impl="xla"
        )

    return jax.jit(step, donate_argnums=(1, 2))


def _nan_cache(num_pages, page_size):
    shape = (CFG.num_layers, CFG.num_kv_heads, num_pages, page_size, CFG.head_dim)
    return jnp.full(shape, jnp.nan, jnp.float32), jnp.full(shape, jnp.nan, jnp.float32)


# One bucket for every step of every test, so the jitted step compiles once per page size / variant
# (padding tokens, padding sequences and page-table padding are exercised on the way).
NUM_PAGES, NUM_TOKENS, MAX_NUM_SEQS, PAGES_PER_SEQ = 16, 16, 2, 6


def _run_step(k_pages, v_pages, seqs, page_size, *, last_only=False):
    """seqs: list of (all_tokens_so_far, q_len, page_table). Returns per-seq logits rows."""
    md, positions, logits_indices = build_metadata(
        [len(t) for t, _, _ in seqs], [q for _, q, _ in seqs], [p for _, _, p in seqs],
        page_size=page_size, num_tokens=NUM_TOKENS, max_num_seqs=MAX_NUM_SEQS,
        pages_per_seq=PAGES_PER_SEQ,
    )  # fmt: skip
    tokens = np.zeros(len(positions), np.int32)
    row = 0
    for toks, q, _ in seqs:
        tokens[row : row + q] = toks[-q:]
        row += q
    # Always NUM_TOKENS logits rows (one compiled shape): every row, or each sequence's last row
    # (the engine's decode case) followed by row-0 padding.
    rows = np.arange(NUM_TOKENS, dtype=np.int32)
    if last_only:
        rows = np.zeros(NUM_TOKENS, np.int32)
        rows[: len(logits_indices)] = logits_indices
    logits, k_pages, v_pages = _paged()(_params(), k_pages, v_pages, tokens, positions, md, rows)
    logits = np.asarray(logits)
    out, row = [], 0
    for i, (_, q, _) in enumerate(seqs):
        out.append(logits[i : i + 1] if last_only else logits[row : row + q])
        row += q
    return out, k_pages, v_pages


@pytest.mark.parametrize("page_size", [8, 16])
def test_paged_prefill_chunks_then_decode_match_dense(page_size):
    rng = np.random.default_rng(page_size)
    chunks, num_decode = [5, 13, 1, 9], 6
    total = sum(chunks) + num_decode
    tokens = rng.integers(0, CFG.vocab_size, total).astype(np.int32)
    want = np.asarray(_dense()(_params(), tokens[None]))[0]  # [total, V]

    num_pages = NUM_PAGES
    table = [int(p) for p in rng.permutation(np.arange(1, num_pages))[: -(-total // page_size)]]
    k_pages, v_pages = _nan_cache(num_pages, page_size)
    steps = chunks + [1] * num_decode
    done = 0
    for i, q in enumerate(steps):
        last_only = i >= len(chunks)  # decode steps select rows with logits_indices
        (got,), k_pages, v_pages = _run_step(
            k_pages, v_pages, [(tokens[: done + q], q, table)], page_size, last_only=last_only
        )
        rows = slice(done + q - 1, done + q) if last_only else slice(done, done + q)
        np.testing.assert_allclose(got, want[rows], **TOL, err_msg=f"step {i} (q_len {q})")
        done += q
    # Untouched pages still hold NaN: nothing was written outside the sequence's pages / NULL_PAGE.
    unused = sorted(set(range(1, num_pages)) - set(table))
    assert np.isnan(np.asarray(k_pages)[:, :, unused]).all()


def test_ragged_batch_equals_each_sequence_alone():
    page_size, num_pages = 8, NUM_PAGES
    rng = np.random.default_rng(1)
    a = rng.integers(0, CFG.vocab_size, 15).astype(np.int32)
    b = rng.integers(0, CFG.vocab_size, 7).astype(np.int32)
    table_a, table_b = [7, 2], [9, 4, 11]
    plan = [(11, 3), (4, 4)]  # (q_len of a, q_len of b) per step
    k, v = _nan_cache(num_pages, page_size)
    batched, done_a, done_b = [], 0, 0
    for qa, qb in plan:
        done_a, done_b = done_a + qa, done_b + qb
        rows, k, v = _run_step(
            k, v, [(a[:done_a], qa, table_a), (b[:done_b], qb, table_b)], page_size
        )
        batched.append(rows)
    for which, (toks, table) in enumerate([(a, table_a), (b, table_b)]):
        k, v = _nan_cache(num_pages, page_size)
        done = 0
        for step, q in enumerate(p[which] for p in plan):
            done += q
            (alone,), k, v = _run_step(k, v, [(toks[:done], q, table)], page_size)
            np.testing.assert_allclose(batched[step][which], alone, **TOL)
        want = np.asarray(_dense()(_params(), toks[None]))[0]
        np.testing.assert_allclose(np.concatenate([r[which] for r in batched]), want, **TOL)


def test_rope_matches_float64_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)  # [T, N, H]
    pos = np.array([0, 1, 7, 100, 2047], np.int32)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), theta=10000.0))
    xd = x.astype(np.float64)
    inv = 10000.0 ** (-np.arange(0, 8, 2) / 8.0)
    ang = pos[:, None, None] * inv  # [T, 1, 4]
    x1, x2 = xd[..., :4], xd[..., 4:]
    want = np.concatenate(
        [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1
    )
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[0], x[0])  # position 0 is the identity
    # Hand case: head_dim 2, theta irrelevant for i=0 (inv_freq 1): rotate (1, 0) by 1 radian.
    one = apply_rope(jnp.array([[[1.0, 0.0]]]), jnp.array([1]), theta=10000.0)
    np.testing.assert_allclose(np.asarray(one)[0, 0], [np.cos(1.0), np.sin(1.0)], atol=1e-6)


def test_rmsnorm_matches_float64_numpy():
    x = np.array([[1.0, -2.0, 3.0, 0.5], [0.0, 0.0, 0.0, 1e-3]], np.float32)
    scale = np.array([1.0, 0.5, 2.0, -1.0], np.float32)
    norm = RMSNorm(eps=1e-5)
    got = np.asarray(norm.apply({"params": {"scale": scale}}, jnp.asarray(x)))
    xd = x.astype(np.float64)
    want = xd / np.sqrt((xd**2).mean(-1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(got, want, **TOL)
    # Hand case: [3, 4] has mean square 12.5.
    got = norm.apply({"params": {"scale": np.ones(2, np.float32)}}, jnp.array([3.0, 4.0]))
    np.testing.assert_allclose(np.asarray(got), np.array([3, 4]) / np.sqrt(12.5 + 1e-5), **TOL)


def test_causal_gqa_attention_matches_float64_numpy():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)  # last 3 of 5 positions
    k = rng.standard_normal((2, 5, 2, 8)).astype(np.float32)
    v = rng.standard_normal((2, 5, 2, 8)).astype(np.float32)
    got = np.asarray(causal_attention(*map(jnp.asarray, (q, k, v)), sm_scale=0.3))
    want = np.zeros(q.shape)
    for bi in range(2):
        for t in range(3):
            for n in range(4):
                s = k[bi, : t + 3, n // 2].astype(np.float64) @ q[bi, t, n] * 0.3
                p = np.exp(s - s.max())
                want[bi, t, n] = (p / p.sum()) @ v[bi, : t + 3, n // 2]
    np.testing.assert_allclose(got, want, **TOL)


def test_dense_with_pallas_kernels_flash_matches_jnp():
    tokens = np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 12)).astype(np.int32)
    model = Llama(CFG)
    want = model.apply(_params(), tokens, method="dense")
    got = model.apply(_params(), tokens, method="dense", attention_impl="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_wrong_cache_shape_raises():
    md, pos, _ = build_metadata([3], [3], [[1]], page_size=8)
    bad = jnp.zeros((CFG.num_layers + 1, CFG.num_kv_heads, 4, 8, CFG.head_dim))
    with pytest.raises(ValueError, match="num_layers=2"):
        Llama(CFG).apply(_params(), jnp.zeros(3, jnp.int32), pos, bad, bad, md)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_heads=6, num_kv_heads=4), "num_heads=6"),
        (dict(d_model=0), "d_model=0"),
        (dict(head_dim=15), "head_dim=15"),
        (dict(dtype="int8"), "dtype='int8'"),
        (dict(norm_eps=0.0), "norm_eps=0.0"),
    ],
)
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**kw)


def test_config_round_trips_through_dict():
    assert LlamaConfig.from_dict(CFG.to_dict()) == CFG
    with pytest.raises(ValueError, match="nope"):
        LlamaConfig.from_dict({**CFG.to_dict(), "nope": 1})


def test_build_metadata_layout_and_errors():
    md, pos, idx = build_metadata(
        [10, 3], [2, 3], [[5, 6], [2]], page_size=8, num_tokens=8, max_num_seqs=4, pages_per_seq=3
    )
    assert isinstance(md, AttentionMetadata)
    np.testing.assert_array_equal(md.slot_mapping, [6 * 8 + 0, 6 * 8 + 1, 16, 17, 18, 0, 0, 0])
    np.testing.assert_array_equal(pos, [8, 9, 0, 1, 2, 0, 0, 0])
    np.testing.assert_array_equal(md.cu_q_lens, [0, 2, 5, 5, 5])
    np.testing.assert_array_equal(md.kv_lens, [10, 3, 0, 0])
    np.testing.assert_array_equal(md.page_indices[1], [2, 0, 0])
    np.testing.assert_array_equal(idx, [1, 4, 0, 0])
    assert md.num_seqs.tolist() == [2]
    with pytest.raises(ValueError, match="q_len=4"):
        build_metadata([3], [4], [[1]], page_size=8)
    with pytest.raises(ValueError, match="kv_len=9"):
        build_metadata([9], [1], [[1]], page_size=8)
    with pytest.raises(ValueError, match="NULL_PAGE"):
        build_metadata([3], [1], [[0]], page_size=8)
    with pytest.raises(ValueError, match="num_tokens=2"):
        build_metadata([3], [3], [[1]], page_size=8, num_tokens=2)


def test_paged_attention_layer_alone_equals_slot_of_stacked_cache():
    attn = PagedAttention(num_heads=4, num_kv_heads=2, head_dim=16)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((6, CFG.d_model)), jnp.float32)
    md, pos, _ = build_metadata([9, 2], [4, 2], [[3, 5], [1]], page_size=8)
    params = {"params": _params()["params"]["layers_0"]["attn"]}
    k_all, v_all = _nan_cache(6, 8)  # [2, 2, 6, 8, 16]
    apply = jax.jit(attn.apply, static_argnames="layer")
    out_l, k_l, v_l = apply(params, x, pos, k_all[1], v_all[1], md)
    out_s, k_s, v_s = apply(params, x, pos, k_all, v_all, md, layer=1)
    np.testing.assert_array_equal(np.asarray(out_s), np.asarray(out_l))
    np.testing.assert_array_equal(np.asarray(k_s[1]), np.asarray(k_l))
    np.testing.assert_array_equal(np.asarray(v_s[1]), np.asarray(v_l))
    assert np.isnan(np.asarray(k_s[0])).all()  # the other layer is untouched


def test_jitted_step_updates_donated_cache_in_place():
    # Slicing a layer out of the stacked cache and setting it back makes XLA copy the pages every
    # step; the model writes into the stacked array instead. Scratch must stay below one layer.
    k, v = _nan_cache(512, 16)
    md, pos, idx = build_metadata([5], [1], [[1]], page_size=16, num_tokens=8, max_num_seqs=2,
                                  pages_per_seq=4)  # fmt: skip
    tokens = np.zeros(len(pos), np.int32)
    compiled = _paged().lower(_params(), k, v, tokens, pos, md, idx).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("backend reports no memory analysis")
    assert stats.temp_size_in_bytes < k.nbytes // CFG.num_layers, stats


def test_bfloat16_compute_and_cache_stay_close_to_dense():
    bf16 = dataclasses.replace(CFG, dtype="bfloat16")
    tokens = np.random.default_rng(5).integers(0, CFG.vocab_size, 20).astype(np.int32)
    want = Llama(CFG).apply(_params(), tokens[None], method="dense")[0]
    md, pos, _ = build_metadata([20], [20], [[3, 1, 2]], page_size=8)
    cache = jnp.zeros((CFG.num_layers, CFG.num_kv_heads, 4, 8, CFG.head_dim), jnp.bfloat16)
    step = jax.jit(lambda p, k, v: Llama(bf16).apply(p, tokens, pos, k, v, md))
    got, k, _ = step(_params(), cache, cache)
    assert got.dtype == jnp.float32 and k.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol("bfloat16"))
