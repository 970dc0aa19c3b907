"""Cascade attention in the engine: the group detector, the cost rule, and unchanged outputs.

Greedy tokens must be identical with ``cascade_attention`` "off", "on" and "auto" with prefix
caching (a shared system prompt), copy-on-write forks (n = 4 samples of one prompt), preemption
and n-gram speculation; "on" must actually have run cascade steps.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import prompts, small_model
from hypothesis import given, settings
from hypothesis import strategies as st

from paged import Engine, EngineConfig, SamplingParams
from paged.config.speculative import SpeculativeConfig
from paged.step.cascade_plan import CascadeCost, CascadePlanner, find_groups

PAGE = 8


@st.composite
def _batches(draw):
    """Tables built from known groups: each group shares ``prefix`` blocks, some members share
    one more block among themselves (a deeper sharing the group's prefix must stop before),
    every other block is the row's own; lone rows and rows too short to share mix in."""
    next_block = [1]

    def fresh(n):
        out = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        return out

    rows, want = [], []
    for _ in range(draw(st.integers(0, 4))):
        prefix = draw(st.integers(1, 4))
        size = draw(st.integers(2, 5))
        shared, extra = fresh(prefix), fresh(1)
        members = []
        for m in range(size):
            own = draw(st.integers(0, 3))
            deeper = extra if m < 2 and own > 0 and size > 2 else []  # two share one more
            table = shared + deeper + fresh(own - len(deeper))
            # kv_len: the newest token sits after every shared block (it is written this step)
            kv_len = len(table) * PAGE + 1 if own == 0 else (len(table) - 1) * PAGE + draw(
                st.integers(1, PAGE))
            members.append(len(rows))
            rows.append((table + fresh(1) if own == 0 else table, kv_len))
        want.append((members, prefix))
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(1, 3))
        rows.append((fresh(n), (n - 1) * PAGE + draw(st.integers(1, PAGE))))
    perm = draw(st.permutations(range(len(rows))))
    tables = np.zeros((max(1, len(rows)), 10), np.int32)
    kv_lens = np.zeros(max(1, len(rows)), np.int32)
    for new, old in enumerate(perm):
        table, kv_len = rows[old]
        tables[new, :len(table)] = table
        kv_lens[new] = kv_len
    where = {old: new for new, old in enumerate(perm)}
    want = [(sorted(where[m] for m in members), prefix) for members, prefix in want]
    return tables[:len(rows)], kv_lens[:len(rows)], sorted(want)


@settings(max_examples=60, deadline=None)
@given(_batches())
def test_find_groups_finds_exactly_the_implied_groups(case):
    tables, kv_lens, want = case
    assert sorted(find_groups(tables, kv_lens, PAGE)) == want


def test_find_groups_never_shares_the_block_being_written():
    # Two forks share 2 blocks, but the second holds the newest token of row 1: only 1 shared.
    tables = np.array([[1, 2, 3], [1, 2, 0]], np.int32)
    assert find_groups(tables, np.array([20, 12]), PAGE) == [([0, 1], 1)]
    assert find_groups(tables, np.array([20, 8]), PAGE) == []  # row 1: no whole block before


def test_planner_modes_and_cost_rule():
    tables = np.array([[1, 2, 3, 9], [1, 2, 4, 0], [5, 6, 0, 0], [1, 2, 7, 0]], np.int32)
    kv_lens = np.array([30, 20, 9, 17])  # group [0, 1, 3] shares 2 blocks (16 tokens)
    assert CascadePlanner("off", PAGE).plan(tables, kv_lens, 4) is None
    on = CascadePlanner("on", PAGE)
    meta = on.plan(tables, kv_lens, 4)
    assert meta.shape == (2, 5) and meta.dtype == np.int32
    assert meta[0].tolist() == [16, 0, 1, 3, -1] and meta[1].tolist() == [0, -1, -1, -1, -1]
    assert on.stats() == {"mode": "on", "steps": 1, "groups": 1, "prefix_tokens_shared": 32}
    # auto: the group saves 2 * 16 = 32 token reads.
    assert CascadePlanner("auto", PAGE, CascadeCost(overhead_tokens=33)).plan(
        tables, kv_lens, 4) is None
    assert CascadePlanner("auto", PAGE, CascadeCost(overhead_tokens=32, min_group_saving_tokens=32)
                          ).plan(tables, kv_lens, 4) is not None  # fmt: skip
    assert CascadePlanner("auto", PAGE, CascadeCost(overhead_tokens=0, min_group_saving_tokens=33)
                          ).plan(tables, kv_lens, 4) is None  # fmt: skip
    with pytest.raises(ValueError, match="cascade_attention"):
        EngineConfig(cascade_attention="yes")
    with pytest.raises(ValueError, match="overhead_tokens"):
        CascadeCost(overhead_tokens=-1)


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(**overrides) -> Engine:
    cfg, params = small_model()
    base = dict(block_size=PAGE, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                attention_impl="xla", debug_checks=True, min_token_bucket=64, min_seq_bucket=8)
    base.update(overrides)
    return Engine(EngineConfig(**base), model_config=cfg, params=params)


def _run(mode, batch, params=GREEDY, **overrides):
    """The tokens of ``batch`` after a first request warmed the prefix cache, and the stats."""
    engine = _engine(cascade_attention=mode, **overrides)
    engine.generate(batch[:1], SamplingParams(max_tokens=1, temperature=0.0))
    outs = engine.generate(batch, params)
    assert all(o.finished for o in outs)
    return [[c.token_ids for c in o.outputs] for o in outs], engine.kv_stats()["cascade"]


SYSTEM = prompts(1, seed=7, min_len=26, max_len=27)[0]  # 27 tokens: 3 full blocks
SHARED = [SYSTEM + p[1:] for p in prompts(5, seed=8, max_len=8)]


@pytest.mark.parametrize("case", [
    dict(),  # shared system prompt (prefix cache hits), continuous batching
    dict(params=SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=4, ignore_eos=True),
         batch=SHARED[:2]),  # CoW forks: n = 4 samples share each prompt
    dict(num_blocks=20),  # a tight pool: preemption
    dict(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2)),
], ids=["system_prompt", "forks_n4", "preemption", "ngram_spec"])  # fmt: skip
def test_greedy_tokens_identical_on_off_auto(case):
    case = dict(case)
    batch, params = case.pop("batch", SHARED), case.pop("params", GREEDY)
    off, stats_off = _run("off", batch, params, **case)
    on, stats_on = _run("on", batch, params, **case)
    auto, _ = _run("auto", batch, params, **case)
    assert on == off and auto == off
    assert stats_off == {"mode": "off", "steps": 0, "groups": 0, "prefix_tokens_shared": 0}
    assert stats_on["steps"] > 0 and stats_on["groups"] >= stats_on["steps"]
    assert stats_on["prefix_tokens_shared"] >= stats_on["groups"] * PAGE


@pytest.mark.parametrize("kv_cache_dtype, granularity", [
    ("int8", "token"), pytest.param("fp8_e4m3", "page", marks=pytest.mark.slow)])
def test_quantized_pages_greedy_tokens_identical_on_off(kv_cache_dtype, granularity):
    """Quantized pages (values + scales): the prefix pass dequantizes the shared pages once for the
    group, the suffix pass each row's own; the greedy tokens are those of cascade off on the same
    quantized cache, and cascade steps were taken."""
    quant = dict(kv_cache_dtype=kv_cache_dtype, kv_scale_granularity=granularity)
    off, _ = _run("off", SHARED, **quant)
    on, stats_on = _run("on", SHARED, **quant)
    assert on == off
    assert stats_on["steps"] > 0 and stats_on["prefix_tokens_shared"] >= stats_on["groups"] * PAGE
    assert _engine(**quant).kv_stats()["ledger"]["categories"]["scales"] > 0  # really quantized


def test_warmup_compiles_the_cascade_shapes():
    """With cascade on, ``warmup()`` also compiles each decode-only bucket's cascade variant, so
    serving a shared prompt (cascade steps taken) traces nothing new, and the warmed engine's
    tokens are those of a cold one (padding groups touch no KV)."""
    engine = _engine(cascade_attention="on", debug_checks=False)
    engine.warmup()
    compiled = engine.num_compilations
    engine.generate(SHARED[:1], SamplingParams(max_tokens=1, temperature=0.0))
    warm = [o.outputs[0].token_ids for o in engine.generate(SHARED, GREEDY)]
    assert engine.kv_stats()["cascade"]["steps"] > 0
    assert engine.num_compilations == compiled
    cold, _ = _run("on", SHARED, debug_checks=False)
    assert warm == [c[0] for c in cold]
