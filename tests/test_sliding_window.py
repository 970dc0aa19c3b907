"""Sliding-window models: greedy tokens equal transformers', blocks recycled exactly by the rule.

Fixtures (``experiments/make_hf_fixtures.py``, made by transformers): ``mistral_sw`` (every layer
slides, W = 16) and ``qwen2_sw`` (layer 0 full, layer 1 slides, W = 16), with 64 greedy tokens of
transformers' no-cache loop on prompts of 1-130 tokens: every prompt but the shortest runs far
past the window.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from paged.kv.block_manager import BlockManager
from paged.models import load_checkpoint
from paged.models.config import LlamaConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
FAST = {"max_model_len": 256, "max_num_seqs": 8, "min_seq_bucket": 8,
        "max_num_batched_tokens": 512, "min_token_bucket": 512}


def _record(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def _check(outs, record: dict, samples: int = 1) -> None:
    for i, (out, want) in enumerate(zip(outs, record["prompts"], strict=True)):
        assert len(out.outputs) == samples
        for sample in out.outputs:
            assert sample.token_ids == want["greedy"], (record["fixture"], i, len(want["ids"]))


def test_fixture_configs_read_as_transformers_reads_them():
    mistral, _ = load_checkpoint(FIXTURES / "mistral_sw")
    qwen, _ = load_checkpoint(FIXTURES / "qwen2_sw")
    assert mistral.layer_windows == (16, 16)
    assert qwen.layer_windows == (None, 16)  # max_window_layers=1: layer 1 and above slide


@pytest.mark.parametrize("name", ["mistral_sw", "qwen2_sw"])
def test_greedy_matches_transformers_past_the_window(name):
    record = _record(name)
    engine = Engine(EngineConfig(model=str(FIXTURES / name), debug_checks=True, **FAST))
    _check(engine.generate([p["ids"] for p in record["prompts"]], GREEDY), record)
    stats = engine.kv_stats()
    # Every layer slides (mistral_sw), or the sliding layers have their own KV-cache group
    # (qwen2_sw, paged.kv.group_manager): blocks were recycled either way.
    assert stats["recycled_blocks"] > 0
    assert stats["ledger"]["recycled_bytes"] == (
        stats["recycled_blocks"] * stats["ledger"]["bytes_per_block"])


@pytest.mark.parametrize("name,mode,blocks", [
    ("mistral_sw", "recompute", 14), ("mistral_sw", "swap", 14), ("qwen2_sw", "recompute", 20),
])  # fmt: skip
def test_greedy_under_preemption_prefix_caching_and_n2(name, mode, blocks):
    """A pool too small for the batch (the all-sliding model recycles, so it gets fewer blocks):
    sequences are preempted and come back; a second round of the same prompts with n=2 hits the
    prefix cache. Tokens never change."""
    record = _record(name)
    engine = Engine(EngineConfig(model=str(FIXTURES / name), num_blocks=blocks, block_size=16,
                                 preemption_mode=mode, enable_prefix_caching=True,
                                 **{**FAST, "max_model_len": 208}))
    prompts = [p["ids"] for p in record["prompts"]]
    _check(engine.generate(prompts, GREEDY), record)
    assert engine.kv_stats()["num_preemptions"] > 0
    two = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, n=2)
    _check(engine.generate(prompts, two), record, samples=2)
    assert engine.kv_stats()["prefix_cache_hit_tokens"] > 0


def test_blocks_recycled_exactly_when_the_rule_says():
    """W = 8, blocks of 4: after the step that computes slot c - 1, block j is free iff
    (j + 1) * 4 <= c - 7; the free count follows that step by step, and the sequence never holds
    more than ceil(8 / 4) + 1 = 3 blocks."""
    B, W = 4, 8
    bm = BlockManager(32, B, sliding_window=W, enable_prefix_caching=False, debug=True)
    assert bm.allocate("s", [1, 2, 3]) == 0
    usable = 31
    held_max = 0
    for c in range(3, 60):
        step = bm.begin_step()
        bm.step_completed(step)
        bm.mark_computed("s", c)
        behind = max(0, (c - W + 1) // B)
        table = bm.block_table("s")
        live = [b for b in table if b != 0]
        assert table[:behind] == [0] * behind and 0 not in table[behind:], (c, table)
        assert bm.num_free_blocks == usable - len(live), c
        held_max = max(held_max, len(live))
        assert bm.append_slots("s", [c + 1]) == []
    assert held_max == -(-W // B) + 1
    assert bm.stats()["recycled_blocks"] == (59 - W + 1) // B
    assert bm.stats()["max_blocks_per_sequence"] == held_max


def test_recycled_blocks_wait_in_quarantine():
    bm = BlockManager(16, 4, sliding_window=4, enable_prefix_caching=False)
    bm.allocate("s", list(range(9)))
    step = bm.begin_step()  # a step that may still read the blocks is in flight
    bm.mark_computed("s", 9)  # block 0 (slots 0-3) is behind position 9's window [6, 9]
    assert bm.block_table("s")[:1] == [0] and bm.num_quarantined_blocks == 1
    bm.step_completed(step)
    assert bm.num_quarantined_blocks == 0 and bm.num_free_blocks == 15 - 2


def test_kv_stats_bound_on_long_outputs():
    """tiny-sliding (W = 32): short prompts, 64 new tokens (past two windows), blocks of 16:
    stepping serially, at most ceil(32 / 16) + 1 = 3 blocks per sequence (overlapped, one more
    for the step in flight) while the full-attention model needs 5."""
    kw = dict(block_size=16, max_model_len=256, max_num_seqs=4, min_seq_bucket=4,
              max_num_batched_tokens=64, min_token_bucket=64)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = ["def f(x):\n", "class A:\n", "import os\n"]
    sliding = Engine(EngineConfig(model="tiny-sliding", async_scheduling=False, **kw))
    sliding.generate(prompts, params)
    full = Engine(EngineConfig(model="tiny", async_scheduling=False, **kw))
    full.generate(prompts, params)
    assert sliding.kv_stats()["max_blocks_per_sequence"] == 3
    assert full.kv_stats()["max_blocks_per_sequence"] == 5  # ceil((10 + 64) / 16)
    assert full.kv_stats()["recycled_blocks"] == 0


def test_config_errors():
    with pytest.raises(ValueError, match="cannot run here"):
        LlamaConfig(num_layers=2, sliding_window=8, layer_types=("full_attention", "chunked"))
    with pytest.raises(ValueError, match="sliding_window is None"):
        LlamaConfig(num_layers=1, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="2 entries for num_layers=3"):
        LlamaConfig(num_layers=3, sliding_window=8, layer_types=("full_attention",) * 2)
    with pytest.raises(ValueError, match="shorter than a block"):
        BlockManager(8, 16, sliding_window=8)
    with pytest.raises(ValueError, match=r"sliding_window=32 is shorter than a page \(block_size=64"):
        Engine(EngineConfig(model="tiny-sliding", block_size=64))
    with pytest.raises(ValueError, match=r"speculative method='draft' needs a model with "
                       r"full-attention layers .*every layer slides"):
        Engine(EngineConfig(model="tiny-sliding", speculative=SpeculativeConfig(
            method="draft", model="tiny-draft", num_speculative_tokens=2)))
    with pytest.raises(ValueError, match="does not recycle"):
        BlockManager(8, 4, sliding_window=8).run_decode_steps([], [])
    for model in ("tiny-sliding", "tiny-mixed"):  # the cascade kernel has no window
        with pytest.raises(ValueError, match=r"cascade_attention='on' needs a model without "
                           r"sliding-window layers"):
            Engine(EngineConfig(model=model, cascade_attention="on"))
