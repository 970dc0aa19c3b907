"""The engine serving packed KV (int4 / int2, KIVI): tokens equal a dense no-cache run over the
same quantize-on-fill semantics (``pallas_kernels.kivi.dense_on_fill``) with chunked prefill,
prefix caching, copy-on-write (n=4), recompute preemption, async scheduling and NaN poisoning on;
one layer's step against the exact K/V (closed pages bit-equal to quantizing the exact page, the
open page exact); the ledger's bytes against ``paged.accounting``; bad settings at
construction."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import greedy_reference, prompts, small_model

from paged import Engine, EngineConfig, SamplingParams
from paged.accounting.formulas import ModelSpec
from paged.kv.open_pages import OpenPages
from paged.models import kivi_attention
from paged.models.attention import build_metadata
from paged.models.config import LlamaConfig
from paged.models.registry import init_params
from pallas_kernels import kivi, packed

BLOCK = 4


@functools.cache
def _model():
    """The small model with its embedding x5 (not x20): greedy tokens that quantize-on-fill
    changes at int4 as well as int2 (the x20 model's int4 tokens equal the exact ones)."""
    cfg, params = small_model()
    return cfg, jax.tree_util.tree_map_with_path(
        lambda path, x: x * 0.25 if "embedding" in jax.tree_util.keystr(path) else x, params)


def _engine(dt: str, **kw) -> Engine:
    cfg, params = _model()
    base = dict(block_size=BLOCK, num_blocks=20, max_num_seqs=6, max_num_batched_tokens=10,
                max_model_len=64, attention_impl="xla", debug_checks=True,
                enable_prefix_caching=True, min_token_bucket=16, min_seq_bucket=8,
                kv_cache_dtype=dt)
    base.update(kw)
    return Engine(EngineConfig(**base), model_config=cfg, params=params)


def _run(engine, ps, params):
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(f"q{i}", p, sp)
    done, stats = {}, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = [c.token_ids for c in o.outputs]
        if stats is None and engine.kv_stats()["num_running"] >= 3:
            stats = engine.kv_stats()  # mid-run: open pages held
    return done, stats


@pytest.mark.parametrize("dt, async_scheduling", [("int4", False), ("int2", True)])
def test_tokens_equal_the_quantize_on_fill_reference(dt, async_scheduling):
    cfg, params = _model()
    engine = _engine(dt, async_scheduling=async_scheduling)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=4)
    ps = prompts(4, seed=4, min_len=5, max_len=22)
    ps = ps + ps[:2]  # repeated prompts hit the prefix cache
    sps = [forked if i == 1 else greedy for i in range(len(ps))]
    done, _ = _run(engine, ps, sps)
    kv_quant = (dt, "token", BLOCK)
    for i, p in enumerate(ps):
        want = greedy_reference(cfg, params, p, 12, eos_id=-1, kv_quant=kv_quant)
        assert done[f"q{i}"] == [want] * (4 if i == 1 else 1), i
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0


def test_the_reference_is_not_the_unquantized_model():
    # Quantize-on-fill must change some greedy token, or the test above could not tell packed
    # pages from exact ones.
    cfg, params = _model()
    ps = prompts(4, seed=4, min_len=5, max_len=22)
    exact = [greedy_reference(cfg, params, p, 12, eos_id=-1) for p in ps]
    for dt in ("int4", "int2"):
        got = [greedy_reference(cfg, params, p, 12, eos_id=-1, kv_quant=(dt, "token", BLOCK))
               for p in ps]
        assert got != exact, dt
