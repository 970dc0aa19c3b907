"""Sparse decode (Quest) in the engine: a covering budget gives the dense engine's tokens; a small
budget gives the same tokens whether the bounds lived through swap, recompute and the host tier
or stayed put; the bounds of every cached block cover its keys; bad settings fail at
construction; the ledger counts the bounds as ``page_metadata``."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import greedy_reference, prompts, small_model

from paged import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from paged.config.sparse_decode import SparseDecodeConfig
from paged.kv import cache as kc
from pallas_kernels import quant

BASE = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
            attention_impl="xla", debug_checks=True, min_token_bucket=32, min_seq_bucket=4)


def _engine(**kw) -> Engine:
    cfg, params = small_model()
    return Engine(EngineConfig(**{**BASE, **kw}), model_config=cfg, params=params)


def _serve(engine, turns, sp):
    return [[c.token_ids for c in o.outputs] for turn in turns for o in engine.generate(turn, sp)]


def _turns(rounds: int = 2) -> list[list[list[int]]]:
    """Six 20-token prefixes (30 blocks, more than a 20-block pool), each sent once per round with
    a new suffix: later rounds hit prefixes the device evicted."""
    pre = prompts(6, seed=1, min_len=19, max_len=20)
    return [[p + [r + 1, i + 7, 3] for i, p in enumerate(pre)] for r in range(rounds)]


def test_a_covering_budget_gives_the_dense_tokens():
    cfg, params = small_model()
    ps = prompts(4, seed=4, min_len=5, max_len=30)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2)
    kw = dict(num_blocks=24, preemption_mode="swap")
    engines = [_engine(sparse_decode=s, **kw) for s in (SparseDecodeConfig(pages=16), None)]
    got, dense = ([*_serve(e, [ps[:2] + ps[:1]], greedy), *_serve(e, [ps[2:]], forked)]
                  for e in engines)
    assert got == dense
    for i, p in enumerate(ps[:2]):
        assert got[i] == [greedy_reference(cfg, params, p, 12, eos_id=-1)]
    stats = engines[0].kv_stats()
    assert stats["num_swap_outs"] > 0
    ledger = stats["ledger"]
    assert ledger["categories"]["page_metadata"] == engines[0].cache.metadata_nbytes > 0
    assert ledger["pool_bytes"] == engines[0].cache.nbytes


@pytest.mark.parametrize("granularity", ["token", "page"])
def test_quantized_pages_a_covering_budget_gives_their_dense_tokens(granularity):
    # int8 pages keep bounds of their dequantized keys (checked exactly below), moved by swap.
    ps = prompts(4, seed=5, min_len=5, max_len=30)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(kv_cache_dtype="int8", kv_scale_granularity=granularity, num_blocks=24,
              preemption_mode="swap")
    engines = [_engine(sparse_decode=s, **kw) for s in (SparseDecodeConfig(pages=16), None)]
    got, dense = (_serve(e, [ps], sp) for e in engines)
    assert got == dense
    assert engines[0].kv_stats()["num_swap_outs"] > 0
    assert _bounds_cover_keys(engines[0], exact=True) >= 1


def _bounds_cover_keys(engine, exact: bool) -> int:
    """Every block holding a prefix key (full, written by one sequence) has bounds that cover
    its keys (equal to their min / max when ``exact``). Returns the blocks checked."""
    bm = engine.block_manager
    blocks = [b for b in range(1, bm.num_blocks) if bm.block_key(b) is not None]
    (k, bounds), _ = kc.swap_out(engine.cache, blocks)  # [L, Hkv, n, page, D], [L, Hkv, n, 2, D]
    k = np.asarray(quant.dequantize(k)).astype(bounds.dtype)  # int8 pages: as the kernels read
    lo, hi = k.min(axis=3), k.max(axis=3)
    if exact:
        np.testing.assert_array_equal(bounds[:, :, :, 0], lo)
        np.testing.assert_array_equal(bounds[:, :, :, 1], hi)
    assert (bounds[:, :, :, 0] <= lo).all() and (bounds[:, :, :, 1] >= hi).all()
    return len(blocks)


@pytest.mark.parametrize("moves", [
    dict(num_blocks=20, preemption_mode="swap", max_num_seqs=6, num_host_blocks=64),
    dict(num_blocks=20, max_num_seqs=2, host_kv_cache_bytes=1 << 20),
])
def test_bounds_survive_what_moves_pages(moves):
    # Swapped and host-tier pages come back with their bounds: the same selections, the same
    # tokens as a pool that moves nothing. (A recomputed sequence is not compared: the prefill
    # recomputes its decoded tokens' KV with dense attention, a different computation.)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    sparse = SparseDecodeConfig(pages=3)  # 3 of up to 9 pages: the selection matters
    still = _serve(_engine(sparse_decode=sparse, num_blocks=120, max_num_seqs=6), _turns(), sp)
    engine = _engine(sparse_decode=sparse, **moves)
    assert _serve(engine, _turns(), sp) == still
    stats = engine.kv_stats()
    if "host_kv_cache_bytes" in moves:
        assert stats["host_tier"]["hit_tokens"] > 0
    else:
        assert stats["num_swap_outs"] == stats["num_preemptions"] > 0
    assert _bounds_cover_keys(engine, exact=True) >= 4


def test_bounds_stay_exact_under_recompute_preemption_and_forks():
    engine = _engine(sparse_decode=SparseDecodeConfig(fraction=0.25), num_blocks=20,
                     max_num_seqs=6)
    _serve(engine, _turns(), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    _serve(engine, _turns(1), SamplingParams(max_tokens=10, temperature=1.0, n=2, seed=3))
    assert engine.kv_stats()["num_preemptions"] > 0
    assert _bounds_cover_keys(engine, exact=False) >= 4


@pytest.mark.parametrize("kw, match", [
    (dict(sparse_decode=0.125), "SparseDecodeConfig"),
    (dict(sparse_decode=SparseDecodeConfig(pages=4), cascade_attention="on"), "cascade"),
    (dict(sparse_decode=SparseDecodeConfig(pages=4), kv_layout="contiguous"), "contiguous"),
    (dict(sparse_decode=SparseDecodeConfig(pages=4), speculative=SpeculativeConfig()),
     "speculative"),
    (dict(sparse_decode=SparseDecodeConfig(pages=4), tensor_parallel_size=2), "tensor_parallel"),
])
def test_bad_settings_fail_at_construction(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        EngineConfig(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(), "exactly one"), (dict(pages=2, fraction=0.5), "exactly one"),
    (dict(pages=1), "pages=1"), (dict(tokens=0), "tokens=0"), (dict(fraction=0.0), "fraction"),
    (dict(fraction=1.5), "fraction"), (dict(pages=True), "pages"),
    (dict(pages=4, dense_layers=-1), "dense_layers"), (dict(pages=4, gqa="mean"), "gqa"),
    (dict(pages=4, recent_pages=-1), "recent_pages"), (dict(pages=4, recent_pages=1.5), "recent"),
])
def test_bad_budgets_fail_at_construction(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SparseDecodeConfig(**kw)


@pytest.mark.parametrize("dense_layers, gqa, fraction, recent", [
    (0, "max", 0.25, 0), (1, "max", 0.25, 0), (0, "rank", 0.25, 0), (1, "union", 0.25, 0),
    (1, "max", 0.5, 2),  # a recent-pages window: up to 5 of 10 pages, 2 of them by score
])
def test_one_token_rows_equal_the_no_cache_reference(dense_layers, gqa, fraction, recent):
    """Every prompt token a one-token row (``max_num_batched_tokens=1``) selects as a decode row
    does: the prompt log-probabilities are the no-cache forward with every position reading
    what its selection keeps (``Llama.dense(sparse=...)``, the teacher-forced perplexity of
    ``experiments.sparse_decode``), and with ``dense_layers`` layers reading every page, for
    each way a query group picks its pages (``gqa``) and with a recent-pages window."""
    import jax
    import jax.numpy as jnp

    from paged.models.llama import Llama

    cfg, params = small_model()
    ids = prompts(1, seed=3, min_len=40, max_len=41)[0]
    sparse = SparseDecodeConfig(fraction=fraction, dense_layers=dense_layers, gqa=gqa,
                                recent_pages=recent)
    engine = _engine(max_num_batched_tokens=1, max_num_seqs=1, min_token_bucket=1,
                     min_seq_bucket=1, sparse_decode=sparse)
    out = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = np.array([out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))])
    lps = {}
    for key, arg in (("sparse", (fraction, 4, dense_layers, gqa, recent)), ("dense", None)):
        logits = Llama(cfg).apply(params, jnp.asarray([ids]), method="dense", sparse=arg)[0]
        lp = np.asarray(jax.nn.log_softmax(logits, -1))
        lps[key] = lp[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(got, lps["sparse"], atol=5e-5)
    assert np.abs(got - lps["dense"]).max() > 0.1  # the selection dropped pages that mattered


def test_a_sliding_model_is_refused_when_the_engine_is_built():
    with pytest.raises(ValueError, match="sliding_window"):
        Engine(EngineConfig(model="tiny-sliding", sparse_decode=SparseDecodeConfig(pages=4)))
