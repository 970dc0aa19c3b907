"""``paged.kv.spec.KVSpec``: one spec from (model, EngineConfig) for the pool, the cache, the
accounting and the simulator."""

from __future__ import annotations

import dataclasses

import pytest

from paged import EngineConfig
from paged.kv.spec import KVSpec
from paged.models.config import LlamaConfig
from paged.sim import H200, LLAMA3_8B, RooflineStepModel
from paged.sim.replica import SimReplica


def test_groups_windows_and_bytes():
    cfg = EngineConfig(block_size=4)
    full = KVSpec.build(LlamaConfig(num_layers=2), cfg)
    assert full.group_windows == (None,) and full.window is None and full.layout is None
    slide = KVSpec.build(LlamaConfig(num_layers=2, sliding_window=8), cfg)
    assert slide.group_windows == (8,) and slide.window == 8  # a one-group spec
    contiguous = KVSpec.build(LlamaConfig(num_layers=2, sliding_window=8),
                              dataclasses.replace(cfg, kv_layout="contiguous"))
    assert contiguous.group_windows == (None,) and contiguous.window == 8  # masked, not recycled
    mixed = KVSpec.build(LlamaConfig(num_layers=4, sliding_window=8,
                                     layer_types=("full_attention", "sliding_attention") * 2), cfg)
    assert mixed.group_windows == (None, 8) and mixed.num_slots == 2
    assert mixed.bytes_per_block == 2 * mixed.bytes_per_page
    for kv in ("auto", "int8"):
        for g in ("token", "page"):
            c = EngineConfig(block_size=16, kv_cache_dtype=kv, kv_scale_granularity=g)
            dims = LLAMA3_8B.with_kv_cache(c)
            assert KVSpec.build(dims, c).bytes_per_block == dims.kv_bytes_per_block(16)
    with pytest.raises(ValueError, match="shorter than a page"):
        KVSpec.build(LlamaConfig(num_layers=2, sliding_window=2), cfg)


def test_salt_names_the_page_format_in_engine_and_simulator_alike():
    model = LLAMA3_8B
    salts = set()
    for kv in ("auto", "int8"):
        cfg = EngineConfig(model="sim", num_blocks=64, block_size=16, kv_cache_dtype=kv,
                           async_scheduling=False)
        spec = KVSpec.build(model, cfg)
        assert f"|{kv}|token" in spec.salt
        rep = SimReplica(cfg, RooflineStepModel(H200, model, block_size=16), model_config=model,
                         build_device=False)
        assert rep.kv_spec == spec and rep.cache_salt == rep.core.block_manager.cache_salt
        salts.add(rep.cache_salt)
    assert len(salts) == 2  # an int8 pool never hits an unquantized pool's keys
