"""The fleet what-if's roofline counts quantized KV bytes (values + scales) from the engine config."""

from __future__ import annotations

import dataclasses

import pytest

from paged import EngineConfig
from paged.accounting import kv_bytes
from paged.sim import LLAMA3_8B, RooflineStepModel, StepShape
from paged.sim.roofline import TensorParallelRooflineStepModel
from paged.sim.specs import DeviceSpec

# One byte per second and no compute bound: a step's time is the bytes it moves, exactly.
BYTES = DeviceSpec(name="bytes", mem_bandwidth=1.0, flop_s=1e30)
L, HKV, D = 32, 8, 128  # Llama-3-8B


def _cfg(kv, gran="token", block=16):
    return EngineConfig(max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=256,
                        block_size=block, kv_cache_dtype=kv, kv_scale_granularity=gran)


def _decode(batch=64, ctx=4096) -> StepShape:  # B decodes at ctx: reads ctx - 1 old + 1 new each
    return StepShape(num_tokens=batch, num_seqs=batch, num_decode=batch, kv_read=batch * (ctx - 1),
                     attn_pairs=batch * ctx, num_samples=batch)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_roofline_counts_quantized_values_and_token_scales_exactly(kv):
    dims = LLAMA3_8B.with_kv_cache(_cfg(kv))
    s = _decode()
    positions = s.kv_read + s.num_tokens  # 64 * 4096
    want_kv = positions * 2 * L * HKV * (D * 1 + 4)  # 1-byte values + one f32 scale per token, head
    assert RooflineStepModel(BYTES, dims).time(s) == LLAMA3_8B.weight_bytes + want_kv
    assert want_kv == kv_bytes(dims.model_spec(), positions)  # the accounting formula agrees
    bf16 = RooflineStepModel(BYTES, LLAMA3_8B).time(s) - LLAMA3_8B.weight_bytes
    assert bf16 == positions * 2 * L * HKV * D * 2 and want_kv / bf16 == (D + 4) / (2 * D)
    tp1 = TensorParallelRooflineStepModel(BYTES, dims, tensor_parallel=1)
    assert tp1.time(s) == LLAMA3_8B.weight_bytes + want_kv


def test_roofline_page_scales_and_pool_geometry():
    dims = LLAMA3_8B.with_kv_cache(_cfg("int8", "page", block=16))
    s = _decode()
    positions = s.kv_read + s.num_tokens  # whole pages: 64 * 256 pages of 16
    want_kv = positions * 2 * L * HKV * D + (positions // 16) * 2 * L * HKV * 4
    assert RooflineStepModel(BYTES, dims, block_size=16).time(s) == LLAMA3_8B.weight_bytes + want_kv
    assert want_kv == kv_bytes(dims.model_spec(), positions, page_size=16)
    # CoW copies and swaps move whole blocks with their scales.
    cow = dataclasses.replace(s, copy_blocks=3)
    block = 16 * 2 * L * HKV * D + 2 * L * HKV * 4
    assert dims.kv_bytes_per_block(16) == block
    assert RooflineStepModel(BYTES, dims, block_size=16).time(cow) == (
        LLAMA3_8B.weight_bytes + want_kv + 2 * block * 3)
    # The pool a byte budget affords: blocks of values + scales (+ the null page).
    budget = 40e9
    assert dims.num_blocks(budget, 16) == int(budget // block) + 1
    assert LLAMA3_8B.num_blocks(budget, 16) == int(budget // (16 * 2 * L * HKV * D * 2)) + 1
    ratio = (dims.num_blocks(budget, 16) - 1) / (LLAMA3_8B.num_blocks(budget, 16) - 1)
    assert 1.99 < ratio < 2.0  # twice the pages, less the scale bytes


def test_bad_kv_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        dataclasses.replace(LLAMA3_8B, kv_cache_dtype="int4")
