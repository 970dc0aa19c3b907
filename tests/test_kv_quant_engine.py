"""A quantized KV cache in the engine: tokens equal a dense no-cache run that quantizes K/V on write
the same way, with prefix caching, copy-on-write (n=4), swap preemption, speculation and debug NaN
poisoning all on; bad settings fail at construction."""

from __future__ import annotations

import pytest
from engine_utils import greedy_reference, prompts, small_model

from paged import Engine, EngineConfig, SamplingParams, SpeculativeConfig

BLOCK = 4


def _engine(kv_cache_dtype: str, granularity: str, **kw) -> Engine:
    cfg, params = small_model()
    base = dict(block_size=BLOCK, num_blocks=28, max_num_seqs=8, max_num_batched_tokens=64,
                max_model_len=64, attention_impl="xla", debug_checks=True,
                preemption_mode="swap", enable_prefix_caching=True, min_token_bucket=64,
                min_seq_bucket=8, kv_cache_dtype=kv_cache_dtype,
                kv_scale_granularity=granularity,
                speculative=SpeculativeConfig(num_speculative_tokens=3))
    base.update(kw)
    return Engine(EngineConfig(**base), model_config=cfg, params=params)


def _prompts() -> list[list[int]]:
    rep = [p * 3 for p in prompts(2, seed=3, min_len=4, max_len=7)]  # n-gram proposals hit
    return rep + prompts(2, seed=4, min_len=5, max_len=20)


@pytest.mark.parametrize("kv_cache_dtype, granularity", [
    ("int8", "token"), pytest.param("int8", "page", marks=pytest.mark.slow), ("fp8_e4m3", "page"),
    ("fp8_e5m2", "token")])
def test_tokens_equal_the_quantize_on_write_reference(kv_cache_dtype, granularity):
    cfg, params = small_model()
    engine = _engine(kv_cache_dtype, granularity)
    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, n=4)
    ps = _prompts()
    ps = ps + ps[:2]  # repeated prompts hit the prefix cache
    for i, p in enumerate(ps):
        engine.add_request(f"q{i}", p, forked if i == 1 else greedy)
    done: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = [c.token_ids for c in o.outputs]
    kv_quant = (kv_cache_dtype, granularity, BLOCK)
    for i, p in enumerate(ps):
        want = greedy_reference(cfg, params, p, 14, eos_id=-1, kv_quant=kv_quant)
        assert done[f"q{i}"] == [want] * (4 if i == 1 else 1), i
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert engine.spec_decode_stats()["num_accepted_tokens"] > 0
    ledger = stats["ledger"]
    assert ledger["categories"]["scales"] == engine.cache.scale_nbytes > 0
    assert ledger["pool_bytes"] == engine.cache.nbytes


def test_the_reference_is_not_the_unquantized_model():
    # The quantize-on-write reference must differ from the exact one somewhere, or the test above
    # could not tell a quantized cache from a plain one.
    cfg, params = small_model()
    ps = prompts(4, seed=1)
    exact = [greedy_reference(cfg, params, p, 16, eos_id=-1) for p in ps]
    quantized = [greedy_reference(cfg, params, p, 16, eos_id=-1, kv_quant=("int8", "page", BLOCK))
                 for p in ps]
    assert exact != quantized


@pytest.mark.parametrize("kw, match", [
    (dict(kv_cache_dtype="int3"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="int8", kv_scale_granularity="channel"), "kv_scale_granularity"),
])
def test_bad_settings_are_refused_at_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_an_fp8_format_the_backend_lacks_is_a_clear_error(monkeypatch):
    from pallas_kernels import quant

    monkeypatch.setitem(quant.QUANT_DTYPES, "fp8_e4m3", "float8_not_in_this_jax")
    with pytest.raises(ValueError, match="does not provide"):
        EngineConfig(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="not supported on"):
        quant.check_backend("int8", backend="no_such_backend")


# Run by test_forced_devices (in its one forced-device subprocess): int8 pages and their scales
# on a 2-device mesh give the 1-device tokens.
MESH_SCRIPT = r"""
import sys
sys.path.insert(0, "tests")
import jax
import numpy as np
from engine_utils import prompts, small_model
from paged import Engine, EngineConfig, SamplingParams

cfg, params = small_model()
conf = EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                    attention_impl="xla", debug_checks=True, min_token_bucket=32, min_seq_bucket=4,
                    kv_cache_dtype="int8", kv_scale_granularity="token")
batch = prompts(3, seed=2)
sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
single = [o.token_ids for o in Engine(conf, model_config=cfg, params=params).generate(batch, sp)]
mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
engine = Engine(conf, model_config=cfg, params=params, mesh=mesh)
sharded = [o.token_ids for o in engine.generate(batch, sp)]
for leaf in (engine.cache.k_pages.values, engine.cache.k_pages.scales, engine.cache.v_pages.scales):
    assert len(leaf.sharding.device_set) == 2 and leaf.sharding.spec[1] == "model", leaf.sharding
assert sharded == single, (sharded, single)
print("MESH_OK")
"""

