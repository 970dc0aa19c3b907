"""The support matrix (`paged.config.support`): every refused pair is refused at construction
with a message naming both mechanisms, every other pair of mechanisms is accepted, and the
table is well formed. One real engine build: the issue-46 crash (a mixed full + sliding model
with prefill/decode replicas) is a refusal now, before any device is placed."""

from __future__ import annotations

import itertools

import pytest

from paged import Engine, EngineConfig, SpeculativeConfig
from paged.config import support
from paged.config.kv_policy import KVPolicyConfig
from paged.config.sparse_decode import SparseDecodeConfig
from paged.config.support import MECHANISMS, REFUSED, check_supported, features


class Model:
    """A duck-typed model config: only its layer windows matter to the matrix."""

    def __init__(self, windows):
        self.layer_windows = tuple(windows)


NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
DRAFT = SpeculativeConfig(method="draft", model="tiny-draft", num_speculative_tokens=2)

# The smallest build turning each mechanism on: (EngineConfig keywords, model windows or None,
# check_supported's keywords).
RECIPES = {
    "quantized_kv": ({"kv_cache_dtype": "int8"}, None, {}),
    "packed_kv": ({"kv_cache_dtype": "int4"}, None, {}),
    "contiguous_layout": ({"kv_layout": "contiguous"}, None, {}),
    "static_scheduling": ({"scheduling": "static"}, None, {}),
    "no_prefix_caching": ({"enable_prefix_caching": False}, None, {}),
    "cache_aware_scheduling": ({"policy": "lpm"}, None, {}),
    "swap": ({"preemption_mode": "swap"}, None, {}),
    "async_scheduling": ({"async_scheduling": True}, None, {}),
    "speculative": ({"speculative": NGRAM}, None, {}),
    "draft": ({"speculative": DRAFT}, None, {}),
    "ngram": ({"speculative": NGRAM}, None, {}),
    "host_tier": ({"host_kv_cache_bytes": 1 << 20}, None, {}),
    "disaggregation": ({"data_parallel_size": 2, "prefill_replicas": 1}, None, {}),
    "data_parallel": ({"data_parallel_size": 2}, None, {}),
    "tensor_parallel": ({"tensor_parallel_size": 2}, None, {}),
    "cascade": ({"cascade_attention": "on"}, None, {}),
    "sliding_window": ({}, (32, 32), {}),
    "window_recycling": ({}, (32, 32), {}),
    "kv_groups": ({}, (None, 32), {}),
    "multi_process": ({}, None, {"processes": True}),
    "engine_processes": ({}, None, {"engine_processes": True}),
    "prefix_eviction": ({"prefix_eviction": "lfu"}, None, {}),
    "sparse_decode": ({"sparse_decode": SparseDecodeConfig(pages=4)}, None, {}),
    "kv_policy": ({"kv_policy": KVPolicyConfig("knorm", budget=0.5)}, None, {}),
}

# Pairs whose recipes cannot both be on (by definition, not by refusal).
EXCLUSIVE = {
    frozenset(p) for p in (
        ("draft", "ngram"),  # one speculative method
        ("window_recycling", "kv_groups"),  # every layer slides, or not
        ("contiguous_layout", "window_recycling"),  # recycling and groups are paged-only
        ("contiguous_layout", "kv_groups"),
        ("packed_kv", "quantized_kv"),  # one kv_cache_dtype per recipe (int4 turns on both)
    )
}
REFUSED_PAIRS = {frozenset((r.a, r.b)) for r in REFUSED}


def _build(names):
    """``(config keywords, model, check keywords)`` turning on every mechanism in ``names``."""
    kw, windows, where = {}, None, {}
    # Generic mechanisms last: any speculative method, any sliding model serves them.
    for name in sorted(names, key=lambda n: n in ("speculative", "sliding_window")):
        if name == "speculative" and "speculative" in kw:
            continue
        if name == "sliding_window" and windows is not None:
            continue
        k, w, x = RECIPES[name]
        if "speculative" in kw and "speculative" in k and kw["speculative"] != k["speculative"]:
            return None
        if windows is not None and w is not None and w != windows:
            return None
        kw.update(k)
        windows = w if w is not None else windows
        where.update(x)
    return kw, Model(windows if windows is not None else (None,)), where


def _check(kw, model, where):
    """EngineConfig (settings-only pairs) then check_supported (the model and the processes)."""
    check_supported(EngineConfig(**kw), model, **where)


def test_every_mechanism_has_a_recipe_that_turns_it_on():
    assert set(RECIPES) == set(MECHANISMS)
    for name in MECHANISMS:
        kw, model, where = _build([name])
        assert name in features(EngineConfig(**kw), model, **where), name


def test_the_table_has_no_duplicate_or_self_pair_and_names_known_mechanisms():
    pairs = [frozenset((r.a, r.b)) for r in REFUSED]
    assert len(pairs) == len(set(pairs))
    for r in REFUSED:
        assert r.a != r.b and r.a in MECHANISMS and r.b in MECHANISMS, r
        assert r.reason and not r.reason.endswith("."), r
    assert not EXCLUSIVE & REFUSED_PAIRS


@pytest.mark.parametrize("row", REFUSED, ids=[f"{r.a}+{r.b}" for r in REFUSED])
def test_every_refused_pair_is_refused_naming_both(row):
    built = _build([row.a, row.b])
    assert built is not None, row
    with pytest.raises(ValueError) as e:
        _check(*built)
    msg = str(e.value)
    # The first refused pair of the build is reported; for this minimal build it is this row
    # unless a recipe turns on a third mechanism that is refused with one of the two.
    assert f"[refused pair: {row.a} + {row.b}]" in msg, msg
    assert row.reason in msg


# Mechanisms that one turns on with another (a refusal of the implied one covers the pair).
IMPLIES = {"draft": {"speculative"}, "ngram": {"speculative"}, "disaggregation": {"data_parallel"},
           "window_recycling": {"sliding_window"}, "kv_groups": {"sliding_window"},
           "sliding_window": {"window_recycling"}, "packed_kv": {"quantized_kv"}}  # the recipe's model: every layer slides


def test_every_other_pair_is_accepted():
    accepted = implied = 0
    impossible = set()
    for a, b in itertools.combinations(sorted(MECHANISMS), 2):
        pair = frozenset((a, b))
        if pair in REFUSED_PAIRS:
            continue
        built = _build([a, b])
        implies = {a, b} | IMPLIES.get(a, set()) | IMPLIES.get(b, set())
        if any(p <= implies for p in REFUSED_PAIRS):  # e.g. draft (speculative) + disaggregation
            assert built is not None
            with pytest.raises(ValueError, match="refused pair"):
                _check(*built)
            implied += 1
            continue
        if built is None:
            impossible.add(pair)
            continue
        kw, model, where = built
        on = features(EngineConfig(**kw), model, **where)
        if not {a, b} <= on:
            impossible.add(pair)
            continue
        _check(kw, model, where)
        accepted += 1
    assert impossible == EXCLUSIVE
    assert accepted > 100 and implied >= 1


def test_a_message_names_both_settings_as_set():
    with pytest.raises(ValueError, match=r"prefill_replicas=1 needs host_kv_cache_bytes=0 \(got "
                                         r"host_kv_cache_bytes=1048576\)"):
        EngineConfig(data_parallel_size=2, prefill_replicas=1, host_kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"preemption_mode='swap' needs the engine's devices in "
                                         r"one process \(got devices spanning processes\)"):
        check_supported(EngineConfig(preemption_mode="swap"), processes=True)


def test_without_a_model_only_settings_pairs_are_checked():
    cfg = EngineConfig(data_parallel_size=2, prefill_replicas=1)
    check_supported(cfg)  # the model is not known yet: no model mechanism
    assert not {"sliding_window", "window_recycling", "kv_groups"} & features(cfg)
    with pytest.raises(ValueError, match=r"disaggregation \+ kv_groups"):
        check_supported(cfg, Model((None, 32)))


def test_the_simulator_refuses_what_the_engine_refuses():
    from paged.sim.linear_model import LinearStepModel
    from paged.sim.replica import SimReplica
    from paged.sim.specs import ModelDims

    dims = ModelDims("tiny-dims", d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=4, ffn_dim=32, vocab_size=512, sliding_window=32)
    with pytest.raises(ValueError, match=r"cascade \+ sliding_window"):
        SimReplica(EngineConfig(cascade_attention="on"), LinearStepModel({}), model_config=dims)
    with pytest.raises(ValueError, match=r"disaggregation \+ window_recycling"):
        SimReplica(EngineConfig(), LinearStepModel({}), model_config=dims, role="prefill")


def test_mixed_model_with_prefill_replicas_is_refused_at_construction():
    """Issue 46 item 1: accepted, then a crash at the first hand-over; now a refusal before any
    device is placed (so one device suffices to see it)."""
    with pytest.raises(ValueError, match=r"prefill_replicas=1 needs a model whose layers all "
                                         r"slide or none does .*disaggregation \+ kv_groups"):
        Engine(EngineConfig(model="tiny-mixed", data_parallel_size=2, prefill_replicas=1))


def test_module_imports_nothing_of_the_package():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(support))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("paged")], imported
