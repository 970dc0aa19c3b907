"""KV-cache groups: a model with full and sliding layers keeps one block table per kind in one pool.

Host bookkeeping (`paged.kv.group_manager.GroupedBlockManager`) is checked call by call with the
invariant checker on; the engine's greedy tokens are checked against transformers (``qwen2_sw``)
and against the contiguous layout, which serves the same model with every layer masked and no
groups (``tiny-mixed``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from paged.config.support import check_supported
from paged.kv.group_manager import GroupedBlockManager
from paged.kv.groups import KVGroupLayout, kv_group_layout
from paged.models.config import LlamaConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
FAST = {"max_model_len": 208, "max_num_seqs": 8, "min_seq_bucket": 8,
        "max_num_batched_tokens": 512, "min_token_bucket": 512}


def test_layout_places_each_kind_in_its_own_group():
    layout = KVGroupLayout.of((None, 32, None, 32))  # tiny-mixed
    assert layout.windows == (None, 32) and layout.num_slots == 2
    assert layout.placement == ((0, 0), (1, 0), (0, 1), (1, 1))
    uneven = KVGroupLayout.of((8, None, 8, 8, None, 8, 8, 8))  # 2 full, 6 sliding: gcd 2
    assert uneven.windows == (8, 8, 8, None) and uneven.num_slots == 2
    assert uneven.placement == ((0, 0), (3, 0), (0, 1), (1, 0), (3, 1), (1, 1), (2, 0), (2, 1))
    mixed = LlamaConfig(num_layers=2, sliding_window=16,
                        layer_types=("full_attention", "sliding_attention"))
    assert kv_group_layout(mixed, EngineConfig()).num_groups == 2
    assert kv_group_layout(mixed, EngineConfig(kv_layout="contiguous")) is None
    assert kv_group_layout(LlamaConfig(num_layers=2, sliding_window=16), EngineConfig()) is None
    assert kv_group_layout(LlamaConfig(num_layers=2), EngineConfig()) is None
    draft = SpeculativeConfig(method="draft", model="tiny-draft", num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"speculative method='draft' needs a model whose layers "
                                         r"all slide or none does .* draft \+ kv_groups"):
        check_supported(EngineConfig(speculative=draft), mixed)


def _step(bm, seq_ids, c):
    bm.step_completed(bm.begin_step())
    for s in seq_ids:
        bm.mark_computed(s, c)


def test_sliding_group_recycles_into_the_shared_pool():
    """W = 8, blocks of 4, no prefix cache: after the step that computes slot c - 1 the sliding
    group holds blocks [(c - 7) // 4, ..) only, the full group every block, and the free count
    follows exactly; blocks the sliding group recycled are taken by the full group."""
    B, W = 4, 8
    bm = GroupedBlockManager(16, B, (None, W), enable_prefix_caching=False, debug=True)
    assert bm.allocate("s", [1, 2, 3]) == 0
    recycled = []
    for c in range(3, 40):
        live = {b for b in bm.group_block_table(1, "s") if b}
        _step(bm, ["s"], c)
        full, slide = bm.group_block_table(0, "s"), bm.group_block_table(1, "s")
        recycled += sorted(live - set(slide))
        behind = max(0, (c - W + 1) // B)
        assert 0 not in full and slide[:behind] == [0] * behind and 0 not in slide[behind:]
        assert bm.num_free_blocks == 15 - len(full) - (len(slide) - behind), c
        assert len(slide) - behind <= -(-W // B) + 1
        assert bm.append_slots("s", [c + 1]) == []
    stats = bm.stats()
    assert stats["recycled_blocks"] == stats["groups"][1]["recycled_blocks"] == (39 - W + 1) // B
    assert len(recycled) == stats["recycled_blocks"]
    assert stats["groups"][1]["max_blocks_per_sequence"] == -(-W // B) + 1
    assert stats["groups"][0]["max_blocks_per_sequence"] == 10
    assert set(bm.group_block_table(0, "s")) & set(recycled)  # one pool: the full group reuses
    assert {bm.block_group(b) for b in bm.group_block_table(0, "s")} == {0}


def test_admission_and_growth_are_one_decision():
    """A prompt that one group could take but not both is refused with nothing changed; a decode
    batch grows in every group or in none."""
    bm = GroupedBlockManager(9, 4, (None, 4), enable_prefix_caching=False, debug=True)
    assert not bm.can_allocate(list(range(17)))  # 5 blocks per group, 8 usable pages
    assert bm.allocate("a", list(range(17))) is None
    assert bm.num_free_blocks == 8 and bm.seq_ids() == []
    assert bm.allocate("a", list(range(12))) == 0  # 3 + 3 pages
    assert bm.allocate("b", [1]) == 0  # 1 + 1
    assert bm.num_free_blocks == 0
    assert bm.append_decode_slots(["a", "b"], [7, 8]) is None  # "a" would start a block
    assert bm.num_tokens("a") == 12 and bm.num_free_blocks == 0
    assert bm.append_slots("b", [9]) == []  # fits in b's tail blocks of both groups
    bm.free("b")
    _step(bm, ["a"], 12)  # the window (4) leaves a's sliding blocks 0 and 1 behind: recycled
    assert bm.group_block_table(1, "a")[:2] == [0, 0] and bm.num_free_blocks == 4
    assert bm.append_decode_slots(["a"], [7]) == []
    assert bm.num_free_blocks == 2


def test_prefix_hit_is_what_every_group_holds_and_is_pinned():
    bm = GroupedBlockManager(40, 4, (None, 8), debug=True)
    prompt = list(range(100, 121))  # 5 full blocks + 1 token
    assert bm.allocate("a", prompt) == 0
    _step(bm, ["a"], 21)
    bm.free("a")
    assert bm.cached_prefix_tokens(prompt) == 20
    assert bm.allocate("b", prompt) == 20
    assert bm.stats()["hit_tokens"] == 20
    # b's sliding table revived its hits and recycled those behind the window again
    assert bm.group_block_table(1, "b")[:3] == [0, 0, 0]
    bm.free("b")
    # evict the least recent cached block (one the sliding group recycled): the hit every
    # group holds shrinks
    assert bm.evict_cached(1) == 1
    assert bm.cached_prefix_tokens(prompt) < 20
    hit = bm.cached_prefix_tokens(prompt)
    assert bm.allocate("c", prompt) == hit
    assert bm.num_computed_tokens("c") == hit


def test_fork_swap_lookahead_and_rollback_per_group():
    bm = GroupedBlockManager(40, 4, (None, 4), num_host_blocks=20, debug=True)
    bm.allocate("a", list(range(10)))
    _step(bm, ["a"], 10)
    bm.fork("a", "b")
    assert bm.group_block_table(0, "a") == bm.group_block_table(0, "b")
    pairs = bm.append_slots("b", [5])  # shared partial tail in both groups: copied in both
    assert len(pairs) == 2 and bm.stats()["cow_copies"] == 2
    assert bm.reserve_lookahead("a", 3, [1, 2, 3]) is not None
    assert bm.num_tokens("a") == 13
    bm.rollback("a", 3)
    assert bm.num_tokens("a") == 10
    live = sum(1 for b in bm.block_table("a") if b)
    bm.begin_step()
    out = bm.swap_out("a")
    assert len(out) == live and bm.is_swapped("a")
    assert len(bm.host_block_table("a")) == live
    assert not bm.can_swap_in("a")  # its swap-out copy has not run yet
    bm.step_completed(bm.last_begun_step)
    bm.begin_step()
    bm.step_completed(bm.last_begun_step)
    assert bm.can_swap_in("a")
    back = bm.swap_in("a")
    assert len(back) == live and not bm.is_swapped("a")
    assert bm.group_block_table(1, "a")[0] == 0  # recycled entries stay recycled
    with pytest.raises(ValueError, match="run_decode_steps"):
        bm.run_decode_steps(["a"], [[1]])


def _record(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text())


@pytest.mark.parametrize("num_blocks,mode", [(20, "swap"), (None, "recompute")])
def test_qwen2_groups_match_transformers_under_swap_prefix_caching_and_n2(num_blocks, mode):
    """qwen2_sw (layer 0 full, layer 1 slides, W = 16), 64 greedy tokens on prompts of 1-130
    tokens, then the same prompts with n = 2: tokens equal transformers'. In a pool too small
    for the batch sequences are swapped out and back (recompute: tests/test_sliding_window.py);
    in a roomy pool the second round is served from the prefix cache."""
    record = _record("qwen2_sw")
    engine = Engine(EngineConfig(model=str(FIXTURES / "qwen2_sw"), num_blocks=num_blocks,
                                 preemption_mode=mode, debug_checks=True, **FAST))
    assert engine.block_manager.num_groups == 2 and engine.cache.num_layers == 1
    prompts = [p["ids"] for p in record["prompts"]]
    for n in (1, 2):
        outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0,
                                                       ignore_eos=True, n=n))
        for out, want in zip(outs, record["prompts"], strict=True):
            assert [s.token_ids for s in out.outputs] == [want["greedy"]] * n
    stats = engine.kv_stats()
    assert stats["recycled_blocks"] > 0
    if num_blocks:
        assert stats["num_swap_outs"] > 0
    else:
        assert stats["num_preemptions"] == 0 and stats["prefix_cache_hit_tokens"] > 0


MIXED = dict(model="tiny-mixed", block_size=16, max_model_len=256, max_num_seqs=4,
             min_seq_bucket=4, max_num_batched_tokens=64, min_token_bucket=64)
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n" * 2, "class A:\n",
           "import os\nimport sys\nimport json\n" * 3]


def _tokens(engine, params=GREEDY):
    return [[s.token_ids for s in o.outputs] for o in engine.generate(PROMPTS, params)]


def test_tiny_mixed_equals_the_masked_engine_and_bounds_the_sliding_group():
    """tiny-mixed (W = 32) grouped and paged vs contiguous (every layer masked, no groups):
    identical greedy tokens, also with n-gram speculation (lookahead and rollback per group);
    the sliding group's blocks per sequence stay bounded while the full group's grow."""
    want = _tokens(Engine(EngineConfig(kv_layout="contiguous", **MIXED)))
    grouped = Engine(EngineConfig(debug_checks=True, async_scheduling=False, **MIXED))
    assert _tokens(grouped) == want
    per = grouped.kv_stats()["block_manager"]["groups"]
    prompt = max(len(grouped.tokenizer.encode(p)) for p in PROMPTS)
    assert per[0]["max_blocks_per_sequence"] == -(-(prompt + 64) // 16)
    # a prompt takes its blocks at admission; past it the window bounds the sliding group
    assert per[1]["max_blocks_per_sequence"] <= max(-(-32 // 16) + 1, -(-prompt // 16))
    assert per[1]["max_blocks_per_sequence"] < per[0]["max_blocks_per_sequence"]
    ngram = Engine(EngineConfig(debug_checks=True, speculative=SpeculativeConfig(
        method="ngram", num_speculative_tokens=3), **MIXED))
    assert _tokens(ngram) == want


def test_grouped_pool_holds_more_sequences_in_the_same_bytes():
    """Same num_blocks (same bytes per block of all layers): 4 sequences of 162 tokens fit the
    grouped pool (11 full-group + at most 3 sliding pages each, in 2 x 29 pages of half a
    block's bytes) without preemption, while the full-attention model of the same shape must
    preempt (11 blocks each of 29). The ledger still sums to the cache's bytes."""
    kw = dict(MIXED, num_blocks=30, async_scheduling=False)
    params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    prompts = ["a", "b", "c", "d"]
    grouped = Engine(EngineConfig(**kw))
    grouped.generate(prompts, params)
    stats = grouped.kv_stats()
    assert stats["num_blocks"] == 2 * (30 - 1) + 1
    assert stats["num_preemptions"] == 0
    assert [g["max_blocks_per_sequence"] for g in stats["block_manager"]["groups"]] == [11, 3]
    ledger = stats["ledger"]
    assert ledger["bytes_per_block"] * stats["num_blocks"] == (
        grouped.cache.k_pages.nbytes + grouped.cache.v_pages.nbytes)
    full = Engine(EngineConfig(**dict(kw, model="tiny")))
    full.generate(prompts, params)
    assert full.kv_stats()["num_preemptions"] > 0
    assert full.kv_stats()["ledger"]["bytes_per_block"] == 2 * ledger["bytes_per_block"]


def test_uneven_kinds_split_into_groups_of_one_size():
    """A random model with 1 full and 2 sliding layers (W = 8): three groups of one layer; greedy
    tokens equal the masked contiguous engine's past the window."""
    from paged.models.registry import init_params

    cfg = LlamaConfig(vocab_size=258, d_model=32, num_layers=3, num_heads=2, num_kv_heads=1,
                      head_dim=16, ffn_dim=64, sliding_window=8, layer_types=(
                          "sliding_attention", "full_attention", "sliding_attention"))
    params = init_params(cfg, seed=1)
    kw = dict(block_size=8, max_model_len=96, max_num_seqs=4, min_seq_bucket=4,
              max_num_batched_tokens=32, min_token_bucket=32)
    prompts = [[1, 5, 9, 200, 7, 7, 3, 40, 41, 42, 43, 44, 45, 46], [1, 2], [1] + [60] * 25]
    params_s = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = Engine(EngineConfig(debug_checks=True, **kw), model_config=cfg, params=params)
    want = Engine(EngineConfig(kv_layout="contiguous", **kw), model_config=cfg, params=params)
    assert got.block_manager.windows == (8, 8, None) and got.cache.num_layers == 1
    assert [o.outputs[0].token_ids for o in got.generate(prompts, params_s)] == [
        o.outputs[0].token_ids for o in want.generate(prompts, params_s)]
    assert got.kv_stats()["recycled_blocks"] > 0


def _snapshot(bm):
    return (bm.num_free_blocks, bm.num_cached_blocks, bm.num_quarantined_blocks,
            bm.num_free_host_blocks,
            {s: (bm.num_tokens(s), bm.num_computed_tokens(s), bm.is_swapped(s)
                 or tuple(bm.block_table(s))) for s in bm.seq_ids()})


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_keep_every_group_consistent(seed):
    """Random admission, growth, steps, forks, lookahead / rollback, swaps, evictions and frees on
    a small pool with a weak hash (every hit goes through full-key verification): the invariant
    checker (every group against the one pool) runs after every call, and a call that answers
    None (the pool or the host slots are short) changed nothing."""
    import random

    rng = random.Random(seed)
    bm = GroupedBlockManager(14, 4, (None, 4), hash_fn=lambda p, ids, s: ids[0] % 2,
                             num_host_blocks=10, debug=True)
    seqs, nxt, inflight = [], 0, []
    for _ in range(400):
        op = rng.choice(["alloc", "alloc", "grow", "decode", "step", "step", "fork", "spec",
                         "swap_out", "swap_in", "free", "evict"])
        resident = [s for s in seqs if not bm.is_swapped(s)]
        before = _snapshot(bm)
        if op == "alloc":
            base = rng.choice(((0, 1, 0, 1, 2, 0, 1, 0, 2, 2, 1, 0, 1), (0, 1, 0, 1, 1, 1, 0, 0)))
            got = bm.allocate(nxt, list(base[:rng.randrange(1, len(base) + 1)]))
            if got is None:
                assert _snapshot(bm) == before
            else:
                seqs.append(nxt)
            nxt += 1
        elif op == "grow" and resident:
            s = rng.choice(resident)
            if bm.num_tokens(s) < 40 and bm.append_slots(s, [rng.randrange(3)] * 2) is None:
                assert _snapshot(bm) == before
        elif op == "decode" and resident:
            batch = rng.sample(resident, rng.randrange(1, len(resident) + 1))
            if bm.append_decode_slots(batch, [1] * len(batch)) is None:
                assert _snapshot(bm) == before
        elif op == "step":
            inflight.append(bm.begin_step())
            if rng.random() < 0.7:
                bm.step_completed(inflight.pop())
                for s in resident:
                    bm.mark_computed(s, bm.num_tokens(s))
        elif op == "fork" and resident:
            s = rng.choice(resident)
            if bm.num_computed_tokens(s) == bm.num_tokens(s):
                bm.fork(s, nxt)
                seqs.append(nxt)
                nxt += 1
        elif op == "spec" and resident:
            s = rng.choice(resident)
            if bm.reserve_lookahead(s, 3, [0, 1, 2]) is None:
                assert _snapshot(bm) == before
            else:
                bm.rollback(s, rng.randrange(4))
        elif op == "swap_out" and resident:
            if bm.swap_out(rng.choice(resident)) is None:
                assert _snapshot(bm) == before
        elif op == "swap_in":
            out = [s for s in seqs if bm.is_swapped(s)]
            if out and bm.swap_in(out[0]) is None:
                assert _snapshot(bm) == before
        elif op == "free" and seqs:
            bm.free(seqs.pop(rng.randrange(len(seqs))))
        elif op == "evict":
            bm.evict_cached(1)
    for step in inflight:
        bm.step_completed(step)
    for s in seqs:
        bm.free(s)
    bm.step_completed(bm.begin_step())
    stats = bm.stats()
    assert stats["allocations"] > 5 and stats["swapped_out_blocks"] > 0 and stats["cow_copies"] > 0
    assert stats["recycled_blocks"] > 0 and stats["hit_tokens"] > 0, stats
    assert bm.num_used_blocks == 0 and bm.num_free_host_blocks == 10
