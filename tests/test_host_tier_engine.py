"""The host KV tier in the engine: greedy tokens identical with the tier on and off on a
multi-turn workload whose prefixes outgrow the device pool (host hits > 0), with preemption by
recompute and by swap, overlap on and off, n > 1, speculation and an int8 cache (scales move with
their pages); debug checks on (both tiers' invariants every step, freed device pages and dead
host slots NaN-poisoned); an abort while ``loading`` frees everything; the tier's bytes are exact
and bounded; bad settings fail at construction."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import prompts, small_model

from paged import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from paged.kv import cache as kc
from paged.request.sequence import SeqStatus

HOST_BYTES = 1 << 20


def _engine(host_bytes: int, **kw) -> Engine:
    cfg, params = small_model()
    base = dict(block_size=4, num_blocks=24, max_num_seqs=3, max_num_batched_tokens=32,
                max_model_len=64, attention_impl="xla", debug_checks=True, min_token_bucket=32,
                min_seq_bucket=4, host_kv_cache_bytes=host_bytes)
    base.update(kw)
    return Engine(EngineConfig(**base), model_config=cfg, params=params)


def _turns(rounds: int = 3) -> list[list[list[int]]]:
    """Six 20-token prefixes (30 blocks of 4, more than the pool), each sent once per round with
    a new suffix: later rounds hit prefixes the device evicted."""
    pre = prompts(6, seed=1, min_len=19, max_len=20)
    return [[p + [r + 1, i + 7, 3] for i, p in enumerate(pre)] for r in range(rounds)]


def _run(host_bytes: int, n: int = 1, **kw):
    engine = _engine(host_bytes, **kw)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=n)
    out = []
    for turn in _turns():
        out += [([c.token_ids for c in o.outputs], o.num_cached_tokens, o.num_host_cached_tokens)
                for o in engine.generate(turn, sp)]
    return out, engine


CASES = {
    "recompute": dict(num_blocks=20),
    "swap-serial": dict(num_blocks=20, preemption_mode="swap", async_scheduling=False),
    "n2-ngram": dict(n=2, speculative=SpeculativeConfig(method="ngram",
                                                        num_speculative_tokens=2)),
    "int8": dict(kv_cache_dtype="int8"),
    # The draft model's cache gets the same offloads and loads (its own host store). Verification
    # hides a wrong draft KV from the tokens (and acceptance barely moves), so the draft's pages
    # are compared directly.
    "draft": dict(speculative=SpeculativeConfig(method="draft", num_speculative_tokens=2)),
}
SLOW = {"n2-ngram", "int8", "draft"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                  for c in CASES])
def test_greedy_tokens_identical_with_the_tier_on_and_off(case):
    kw = dict(CASES[case])
    off, engine_off = _run(0, **kw)
    on, engine = _run(HOST_BYTES, **kw)
    assert [o[0] for o in on] == [o[0] for o in off]
    tier = engine.kv_stats()["host_tier"]
    assert tier["hit_tokens"] > 0 and tier["loaded_blocks"] > 0 and tier["offloaded_blocks"] > 0
    assert sum(o[2] for o in on) > 0 and all(o[2] == 0 for o in off)
    assert all(host <= cached for _, cached, host in on)
    assert sum(o[1] for o in on) > sum(o[1] for o in off)  # evictions turned into hits
    if case in ("recompute", "swap-serial"):
        assert engine.kv_stats()["num_preemptions"] > 0
    assert engine_off.kv_stats()["host_tier"]["num_blocks"] == 0
    if case != "int8":  # KV of the blocks both runs hold equals (loaded here, computed there)
        assert_same_cached_kv(engine_off, engine, lambda e: e.cache)
    if case == "draft":
        assert_same_cached_kv(engine_off, engine, lambda e: e.speculator.draft.cache)


def assert_same_cached_kv(engine_off, engine, cache_of) -> None:
    """Every block both engines hold under the same key has the same K/V in ``cache_of(engine)``
    (float rounding apart: chunking differs); some of them were loaded from the host tier."""
    def pages(e):
        bm = e.block_manager
        return {(key.salt, key.prefix_token_ids()): b for b in range(1, bm.num_blocks)
                if (key := bm.block_key(b)) is not None}

    off, on = pages(engine_off), pages(engine)
    both = sorted(set(off) & set(on))
    assert len(both) >= 4
    k0, v0 = kc.swap_out(cache_of(engine_off), [off[c] for c in both])
    k1, v1 = kc.swap_out(cache_of(engine), [on[c] for c in both])
    np.testing.assert_allclose(k1, k0, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(v1, v0, rtol=1e-4, atol=1e-4)


def test_the_tier_bytes_are_exact_and_bounded():
    _, engine = _run(HOST_BYTES)
    stats = engine.kv_stats()
    tier, ledger = stats["host_tier"], stats["ledger"]
    per_block = ledger["bytes_per_block"]
    assert tier["num_blocks"] == HOST_BYTES // per_block
    assert tier["bytes"] == engine.host_tier.nbytes <= HOST_BYTES
    assert sum(ledger["host_tier"].values()) == tier["bytes"]
    assert tier["used_bytes"] == ledger["host_tier"]["cached"] > 0  # nothing in flight now
    assert tier["offloaded_bytes"] == tier["offloaded_blocks"] * per_block
    assert stats["prefix_cache_hit_tokens"] >= tier["hit_tokens"] > 0
    assert tier["num_loads"] > 0 and tier["load_wait_s"] > 0 and tier["num_loading"] == 0


def test_a_small_tier_evicts_and_stays_within_its_slots():
    cfg, _ = small_model()
    per_block = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 4
    off, _ = _run(0)
    on, engine = _run(6 * per_block)
    assert [o[0] for o in on] == [o[0] for o in off]
    tier = engine.kv_stats()["host_tier"]
    assert tier["num_blocks"] == 6 and tier["used_blocks"] <= 6 and tier["evicted_blocks"] > 0


def test_warmup_compiles_the_tier_copies_and_keeps_the_tier():
    off, _ = _run(0)
    engine = _engine(HOST_BYTES)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    turns = _turns()
    got = [o.token_ids for o in engine.generate(turns[0], sp)]
    hits = engine.kv_stats()["host_tier"]["hit_tokens"]
    engine.warmup(logprobs=False, parallel_sampling=False)  # after serving: slots must survive
    for turn in turns[1:]:
        got += [o.token_ids for o in engine.generate(turn, sp)]
    assert got == [o[0][0] for o in off]
    assert engine.kv_stats()["host_tier"]["hit_tokens"] > hits


def test_an_abort_while_loading_frees_everything():
    engine = _engine(HOST_BYTES)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    turns = _turns(2)
    engine.generate(turns[0], sp)
    for i, p in enumerate(turns[1]):
        engine.add_request(f"r{i}", p, sp)
    aborted = None
    while engine.has_unfinished_requests():
        engine.step()
        if aborted is None and engine.scheduler.loading:
            seq = engine.scheduler.loading[0]
            assert seq.status is SeqStatus.LOADING
            aborted = seq.request_id
            assert engine.abort(aborted)
    assert aborted is not None
    stats = engine.kv_stats()
    assert stats["num_used_blocks"] == stats["num_quarantined_blocks"] == 0
    assert stats["host_tier"]["num_loading"] == 0
    assert stats["ledger"]["host_tier"]["loading"] == stats["ledger"]["host_tier"]["offloading"] == 0
    engine.core.check_invariants()


@pytest.mark.parametrize("kw, match", [
    (dict(host_kv_cache_bytes=100), "holds no block"),
    (dict(host_kv_cache_bytes=HOST_BYTES, kv_layout="contiguous"), "kv_layout"),
    (dict(host_kv_cache_bytes=HOST_BYTES, enable_prefix_caching=False), "prefix_caching"),
    (dict(host_kv_cache_bytes=-1), "host_kv_cache_bytes"),
])
def test_bad_settings_fail_at_construction(kw, match):
    cfg, params = small_model()
    with pytest.raises(ValueError, match=match):
        Engine(EngineConfig(block_size=4, max_model_len=64, **kw), model_config=cfg,
               params=params)
