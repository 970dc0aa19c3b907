"""The simulator models sliding windows (in-window reads, the real block recycling) and cascade
attention (a group's shared prefix read once): shapes and bytes checked by hand on tiny dims."""

from __future__ import annotations

import dataclasses
import math

import pytest

from paged import EngineConfig
from paged.sim import ModelDims, RooflineStepModel, Simulator, StepShape, StepTimeModel
from paged.sim.batches import window_pairs
from paged.sim.specs import DeviceSpec
from paged.workload import workload as wl

# One byte per second and no compute bound: a step's time is the bytes it moves, exactly.
BYTES = DeviceSpec(name="bytes", mem_bandwidth=1.0, flop_s=1e30)
# L=2, Hkv=2, D=4, bf16: 2 * 2 * 2 * 4 * 2 = 64 KV bytes per token.
TINY = ModelDims("tiny-dims", d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                 ffn_dim=32, vocab_size=512)  # byte tokens + BOS, EOS


class Recorder(StepTimeModel):
    """1 ms per step; keeps every shape (stateful: no fast-forward)."""

    def __init__(self):
        self.shapes = []

    def time(self, shape):
        self.shapes.append(shape)
        return 1e-3


def _config(**kw) -> EngineConfig:
    base = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
            "block_size": 8, "async_scheduling": False, "num_blocks": 64}
    base.update(kw)
    return EngineConfig(**base)


def _run(cfg, dims, w, model=None):
    rec = model or Recorder()
    res = Simulator(cfg, rec, model_config=dims, build_device=False).run(w)
    return res, rec


def _one(prompt_len, output_len):
    return wl.make_workload("fixed", 1, None, max_model_len=256, seed=0, arrival_times=[0.0],
                            prompt_len=prompt_len, output_len=output_len)


def test_window_pairs_by_hand():
    assert window_pairs(5, 16) == 15  # 1 + 2 + 3 + 4 + 5
    assert window_pairs(40, 16) == 136 + 24 * 16  # 1..16, then 16 per position
    assert window_pairs(0, 16) == 0


def test_windowed_shapes_count_in_window_positions_exactly():
    dims = dataclasses.replace(TINY, sliding_window=16)
    # 40-token prompt in chunks of 16, 16, 8 (budget 16), then decodes.
    res, rec = _run(_config(max_num_batched_tokens=16), dims, _one(40, 6))
    s = rec.shapes
    # Chunk c=0, n=16: keys 0..15; chunk c=16: keys 1..31 (31); chunk c=32, n=8: keys 17..39 (23).
    assert [(x.num_tokens, x.kv_read, x.attn_pairs) for x in s[:3]] == [
        (16, 16, 136), (16, 31, 16 * 16), (8, 23, 8 * 16)]
    # Decodes past the window read W positions each.
    assert all(x.num_decode == 1 and x.kv_read == 16 and x.attn_pairs == 16 for x in s[3:])
    assert len(s) == 3 + 5 and res.summary["completed"] == 1
    # Full attention: the same steps read every position.
    _, full = _run(_config(max_num_batched_tokens=16), TINY, _one(40, 6))
    assert [(x.kv_read, x.attn_pairs) for x in full.shapes[:3]] == [
        (16, 136), (32, 16 * 16 + 136), (40, 8 * 32 + 36)]
    assert [x.kv_read for x in full.shapes[3:]] == [41, 42, 43, 44, 45]


def test_roofline_bytes_of_a_windowed_and_a_cascade_step_by_hand():
    per_token = 2 * 2 * 2 * 4 * 2
    assert TINY.kv_bytes_per_token == per_token
    sm = RooflineStepModel(BYTES, dataclasses.replace(TINY, sliding_window=16))
    w = TINY.weight_bytes
    # One decode at position 100 under a window of 16: reads 16 positions, writes 1.
    dec = StepShape(num_tokens=1, num_seqs=1, num_decode=1, kv_read=16, attn_pairs=16,
                    num_samples=1)
    assert sm.time(dec) == w + (16 + 1) * per_token
    # Three decodes of 100 positions sharing a 64-token prefix read it once: 2 * 64 saved.
    casc = StepShape(num_tokens=3, num_seqs=3, num_decode=3, kv_read=300, attn_pairs=300,
                     num_samples=3, kv_shared=128)
    assert RooflineStepModel(BYTES, TINY).time(casc) == w + (300 - 128 + 3) * per_token
    assert RooflineStepModel(BYTES, TINY).time(dataclasses.replace(casc, kv_shared=0)) == \
        w + 303 * per_token


def test_sim_replica_recycles_window_blocks_and_bounds_blocks_per_sequence():
    w = wl.make_workload("fixed", 6, 100.0, max_model_len=256, seed=1, prompt_len=10,
                         output_len=100)
    sm = RooflineStepModel(BYTES, TINY)
    dims = dataclasses.replace(TINY, sliding_window=16)
    res, _ = _run(_config(), dims, w, dataclasses.replace(sm, model=dims))
    full, _ = _run(_config(), TINY, w, sm)
    s, f = res.summary, full.summary
    assert s["completed"] == f["completed"] == 6
    assert s["max_blocks_per_sequence"] <= math.ceil(16 / 8) + 1  # ceil(W / B) + 1
    assert f["max_blocks_per_sequence"] == math.ceil(110 / 8) and f["recycled_blocks"] == 0
    # Each sequence (110 positions, 14 blocks) ends holding the blocks of [110 - 16, 110): 3.
    assert s["recycled_blocks"] == 6 * (14 - 3)
    assert res.replicas[0]["num_fast_forward_steps"] == 0  # stepping: run_decode_steps has no window
    assert s["median_tpot_ms"] < f["median_tpot_ms"]  # fewer bytes read per decode


def test_window_shorter_than_a_block_is_a_clear_error():
    with pytest.raises(ValueError, match="sliding_window=4"):
        Simulator(_config(), Recorder(), model_config=dataclasses.replace(TINY, sliding_window=4))
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(TINY, sliding_window=0)


def test_cascade_shapes_save_the_shared_prefix_reads():
    # 4 requests share BOS + 63 prefix tokens = 64 tokens = 8 whole blocks; the first is cached by
    # the time the other three arrive.
    w = wl.make_workload("fixed", 4, None, max_model_len=256, seed=2, prompt_len=8,
                         output_len=40, shared_prefix_len=63, arrival_times=[0.0, 0.005, 0.005, 0.005])
    shapes, summary = {}, {}
    for mode in ("off", "on"):
        res, rec = _run(_config(cascade_attention=mode), TINY, w)
        assert res.summary["completed"] == 4
        shapes[mode], summary[mode] = rec.shapes, res.summary
    four = [x for x in shapes["on"] if x.num_decode == x.num_seqs == 4]
    assert four and all(x.kv_shared == 3 * 64 for x in four)  # (members - 1) * prefix tokens
    assert all(x.kv_shared == 0 for x in shapes["off"])
    # The schedule is the same; only the bytes differ.
    assert [dataclasses.replace(x, kv_shared=0) for x in shapes["on"]] == shapes["off"]
    assert summary["on"]["cascade_steps"] == len([x for x in shapes["on"] if x.kv_shared])
    assert summary["on"]["cascade_prefix_tokens_shared"] == sum(x.kv_shared for x in shapes["on"])
    assert summary["off"]["cascade_steps"] == 0
    on, _ = _run(_config(cascade_attention="on"), TINY, w, RooflineStepModel(BYTES, TINY))
    off, _ = _run(_config(cascade_attention="off"), TINY, w, RooflineStepModel(BYTES, TINY))
    assert on.summary["median_tpot_ms"] < off.summary["median_tpot_ms"]
