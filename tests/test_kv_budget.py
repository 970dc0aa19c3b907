"""experiments.kv_budget: one KV byte budget, each arm's blocks in its own format; bad settings
are clear errors."""

from __future__ import annotations

import pytest

from experiments import kv_budget
from paged import EngineConfig
from paged.models.config import LlamaConfig

# 2 layers, 2 KV heads of 16: a block of 8 is 2*2*2*8*16 = 1024 values.
MODEL = LlamaConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=128)


def _arms(**extra):
    base = dict(block_size=8, max_model_len=32, max_num_seqs=4)
    return [("f32", EngineConfig(**base)),
            ("int8", EngineConfig(kv_cache_dtype="int8", **base)),
            ("fp8p", EngineConfig(kv_cache_dtype="fp8_e4m3", kv_scale_granularity="page", **base)),
            *[(k, EngineConfig(**base, **v)) for k, v in extra.items()]]


def test_blocks_by_hand():
    budget = 40_000
    sized = kv_budget.size_arms(_arms(), MODEL, budget, {"f32": "bfloat16"})
    pools = {name: pool for name, _, pool in sized}
    # bfloat16: 1024 values * 2 B; int8: 1024 B + a f32 scale per (layer, K/V, head, token) =
    # 2*2*2*8*4 = 256 B; fp8 per page: 1024 B + 2*2*2*4 = 32 B.
    assert [pools[n]["bytes_per_block"] for n in ("f32", "int8", "fp8p")] == [2048, 1280, 1056]
    assert [pools[n]["num_blocks"] for n in ("f32", "int8", "fp8p")] == [19, 31, 37]
    assert [cfg.num_blocks for _, cfg, _ in sized] == [19, 31, 37]
    assert pools["f32"]["kv_format"] == "bfloat16" and pools["f32"]["priced_as"] == "bfloat16"
    assert pools["int8"]["kv_format"] == "int8:token"
    assert pools["fp8p"]["kv_format"] == "fp8_e4m3:page"
    assert all(p["priced_pool_bytes"] <= budget for p in pools.values())
    unpriced = {n: p["num_blocks"] for n, _, p in kv_budget.size_arms(_arms(), MODEL, budget)}
    assert unpriced["f32"] == budget // 4096  # float32 pages: 9 blocks


@pytest.mark.parametrize("pairs, match", [
    ((("nope", "bfloat16"),), "names arm 'nope'"),
    ((("int8", "bfloat16"),), "only an auto arm"),
    ((("f32", "float16"),), "must be one of"),
    ((("f32", "bfloat16"), ("f32", "float32")), "priced twice"),
    (("f32",), "pair"),
])
def test_bad_pricing_is_refused(pairs, match):
    with pytest.raises(ValueError, match=match):
        kv_budget.check_priced_as(pairs, _arms(), "kv_budget_priced_as")


def test_a_budget_too_small_or_a_fixed_pool_is_refused():
    with pytest.raises(ValueError, match="cannot hold one request"):
        kv_budget.size_arms(_arms(), MODEL, 4096 * 4)  # float32: 4 blocks < 5
    with pytest.raises(ValueError, match="at least 2"):
        kv_budget.size_arms(_arms(), MODEL, 100)
    fixed = [("x", EngineConfig(block_size=8, max_model_len=32, num_blocks=9))]
    with pytest.raises(ValueError, match="sets num_blocks=9"):
        kv_budget.size_arms(fixed, MODEL, 1 << 20)
