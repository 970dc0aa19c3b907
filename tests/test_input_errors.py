"""Every bad input is a clear error (TypeError: wrong type, ValueError: bad value), raised before
any state changes; and the input-related engine invariants (resident sequences, cached-token
counts, prompt + output <= max_model_len, per-tenant prefix-cache isolation)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from engine_utils import prompts, small_model

from paged import Engine, EngineConfig, SamplingParams, accounting
from paged.config.engine_config import check_attention_impl, impls_for_backend
from paged.kv import cache as kc
from paged.util import validate
from paged.workload import workload as wl

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(**overrides) -> Engine:
    """A small engine; the defaults are shared so that the tests share compiled step shapes (one
    token bucket, one sequence bucket, one pool: 11 usable blocks of 8, small enough to preempt)."""
    cfg, params = small_model()
    base = dict(block_size=8, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64,
                max_model_len=64, min_token_bucket=64, min_seq_bucket=4, attention_impl="xla")
    base.update(overrides)
    return Engine(EngineConfig(**base), model_config=cfg, params=params)


def _drain(engine: Engine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


def _unchanged(engine: Engine) -> None:
    """Nothing was queued: no request, no sequence, nothing to step."""
    assert not engine.has_unfinished_requests()
    assert engine.unfinished_request_ids() == []
    assert engine.step() == []


# --- the validators -----------------------------------------------------------------------
@pytest.mark.parametrize("call, exc, match", [
    (lambda: validate.integer("x", True), TypeError, "x=True"),
    (lambda: validate.integer("x", 2.0), TypeError, "x=2.0"),
    (lambda: validate.integer("x", "3"), TypeError, "x='3'"),
    (lambda: validate.integer("x", None), TypeError, "x=None"),
    (lambda: validate.integer("x", 0, minimum=1), ValueError, "x=0 must be a positive integer"),
    (lambda: validate.integer("x", 9, maximum=8), ValueError, "x=9 must be <= 8"),
    (lambda: validate.real("x", True), TypeError, "x=True"),
    (lambda: validate.real("x", "1.5"), TypeError, "x='1.5'"),
    (lambda: validate.real("x", math.nan), ValueError, "x=nan"),
    (lambda: validate.real("x", math.inf), ValueError, "finite"),
    (lambda: validate.real("x", 10**400), ValueError, "float32"),
    (lambda: validate.real("x", 1e39), ValueError, "float32"),
    (lambda: validate.real("x", 0.0, minimum=0, exclusive=True), ValueError, "x=0.0 must be > 0"),
    (lambda: validate.boolean("x", "no"), TypeError, "x='no'"),
    (lambda: validate.boolean("x", 1), TypeError, "x=1"),
    (lambda: validate.one_of("x", "c", ("a", "b")), ValueError, r"x='c' must be one of \('a', 'b'\)"),
    (lambda: validate.string("x", 5), TypeError, "x=5"),
    (lambda: validate.string("x", ""), ValueError, "non-empty"),
])
def test_validators_name_the_argument_and_the_rule(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_validators_return_normalised_values():
    assert validate.integer("x", np.int64(3)) == 3 and type(validate.integer("x", np.int8(3))) is int
    assert validate.integer("x", None, allow_none=True) is None
    assert validate.real("x", np.float32(1.5)) == 1.5 and validate.real("x", 2) == 2.0
    assert validate.real("x", math.inf, allow_inf=True) == math.inf
    assert validate.boolean("x", np.bool_(True)) is True
    assert validate.token_ids("x", np.array([1, 2], np.int32)) == [1, 2]
    assert validate.token_ids("x", (np.int64(4), 5)) == [4, 5]


def test_the_package_modules_share_the_validator():
    with pytest.raises(TypeError, match="n=True"):
        accounting.allocated_positions(True, 16)
    with pytest.raises(TypeError, match="page_size=2.0"):
        kc.KVCache.create(1, 1, 4, 2.0, 8)
    with pytest.raises(ValueError, match="burstiness=inf"):
        wl.gamma_arrivals(1.0, 3, burstiness=math.inf, seed=0)
    with pytest.raises(ValueError, match="arrival_s=nan"):
        wl.RequestSpec("r", math.nan, None, None, prompt_len=1, output_len=1)
    with pytest.raises(TypeError, match=r"prompt_token_ids\[1\]=1.5"):
        wl.RequestSpec("r", 0.0, (1, 1.5), None, prompt_len=2, output_len=1)


# --- 1. add_request checks every argument before any state changes -------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(arrival_time="yesterday"), TypeError, "arrival_time='yesterday'"),
    (dict(arrival_time=[1.0]), TypeError, "arrival_time"),
    (dict(arrival_time=True), TypeError, "arrival_time=True"),
    (dict(arrival_time=math.nan), ValueError, "arrival_time=nan"),
    (dict(arrival_time=math.inf), ValueError, "arrival_time=inf"),
    (dict(timeout_s="5"), TypeError, "timeout_s='5'"),
    (dict(timeout_s=0), ValueError, "timeout_s=0"),
    (dict(timeout_s=-1.0), ValueError, "timeout_s=-1.0"),
    (dict(timeout_s=math.inf), ValueError, "timeout_s=inf"),
    (dict(request_id=""), ValueError, "request_id"),
    (dict(request_id=7), TypeError, "request_id=7"),
    (dict(params="greedy"), TypeError, "SamplingParams"),
    (dict(params=SamplingParams(n=5)), ValueError, "max_num_seqs"),
    (dict(prompt=b"bytes"), TypeError, "prompt"),
    (dict(cache_salt=""), ValueError, "cache_salt"),
    (dict(cache_salt=5), TypeError, "cache_salt=5"),
])
def test_add_request_rejects_bad_arguments_before_changing_state(kwargs, exc, match):
    engine = _engine()
    args = {"request_id": "r", "prompt": "hello", "params": GREEDY, **kwargs}
    with pytest.raises(exc, match=match):
        engine.add_request(args.pop("request_id"), args.pop("prompt"), args.pop("params"), **args)
    _unchanged(engine)


def test_a_bad_arrival_time_cannot_break_later_preemption():
    # The tiny pool forces preemption, which compares arrival times.
    engine = _engine()
    with pytest.raises(TypeError, match="arrival_time"):
        engine.add_request("bad", prompts(1)[0], GREEDY, arrival_time="yesterday")
    for i, p in enumerate(prompts(4, seed=3, min_len=20, max_len=30)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0,
                                                      ignore_eos=True))
    outs = _drain(engine)
    assert len(outs) == 4 and engine.kv_stats()["num_preemptions"] > 0


# --- 2. resident sequences never exceed max_num_seqs ---------------------------------------
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_pending_forks_count_against_max_num_seqs(async_scheduling):
    # Async: the samples fork when the prompt's first token is read back, a step later.
    engine = _engine(async_scheduling=async_scheduling)
    # Short prompts: all four requests are admitted in the first step, whose end forks n3.
    engine.add_request("n3", [256, 1, 2], SamplingParams(n=3, max_tokens=4, temperature=1.0))
    for i in range(3):
        engine.add_request(f"r{i}", [256, 3 + i, 4], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.kv_stats()["num_running"]
        assert running <= 4, f"{running} sequences resident with max_num_seqs=4"


# --- 3. floats must be finite and fit in float32 -------------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(temperature=10**400), ValueError, "temperature"),
    (dict(temperature=1e39), ValueError, "temperature"),
    (dict(temperature=math.inf), ValueError, "temperature=inf"),
    (dict(temperature=math.nan), ValueError, "temperature=nan"),
    (dict(temperature="1.0"), TypeError, "temperature='1.0'"),
    (dict(top_p=math.nan), ValueError, "top_p=nan"),
    (dict(top_p=True), TypeError, "top_p=True"),
    (dict(max_tokens=2.0), TypeError, "max_tokens=2.0"),
    (dict(n=True), TypeError, "n=True"),
    (dict(seed=2**31), ValueError, "seed"),
    (dict(ignore_eos="no"), TypeError, "ignore_eos='no'"),
    (dict(stop_token_ids=(1.5,)), TypeError, r"stop_token_ids\[0\]=1.5"),
    (dict(stop_token_ids=7), TypeError, "stop_token_ids"),
])
def test_sampling_params_reject_bad_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_largest_float32_temperature_is_accepted_and_samples():
    big = float(np.finfo(np.float32).max)
    [out] = _engine().generate(["hi"], SamplingParams(max_tokens=3, temperature=big, seed=1))
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("value, exc", [
    (math.inf, ValueError), (math.nan, ValueError), (10**400, ValueError), (1e39, ValueError),
    (0, ValueError), ("1", TypeError), (True, TypeError)])
def test_request_timeout_must_be_a_finite_positive_number(value, exc):
    with pytest.raises(exc, match="request_timeout_s"):
        EngineConfig(request_timeout_s=value)


# --- 4. token ids are integers, never coerced ---------------------------------------------
@pytest.mark.parametrize("prompt, exc, match", [
    ([256, 1.5, 2.7], TypeError, r"prompt\[1\]=1.5"),
    ([True, False], TypeError, r"prompt\[0\]=True"),
    (["256", "7"], TypeError, r"prompt\[0\]='256'"),
    ([[256, 1], [2]], TypeError, r"prompt\[0\]"),
    (np.array([[256, 1], [2, 3]]), ValueError, "1-D"),
    (np.array([256.0, 1.0]), TypeError, "dtype float64"),
    (np.array([True, False]), TypeError, "dtype bool"),
    ([256, 258], ValueError, "outside"),
    ([-1], ValueError, "outside"),
    ([], ValueError, "empty"),
    (7, TypeError, "prompt"),
])
def test_prompt_token_ids_are_not_coerced(prompt, exc, match):
    engine = _engine()
    with pytest.raises(exc, match=match):
        engine.add_request("r", prompt, GREEDY)
    _unchanged(engine)


def test_integer_token_ids_of_any_integer_type_are_accepted():
    engine = _engine()
    want = engine.generate([[256, 5, 9]], GREEDY)[0].token_ids
    for prompt in (np.array([256, 5, 9], np.int32), [np.int64(256), 5, np.uint8(9)], (256, 5, 9)):
        assert engine.generate([prompt], GREEDY)[0].token_ids == want


# --- 5. a failed generate / add_request changes nothing -----------------------------------
def _sampled(engine: Engine) -> list[int]:
    """An unseeded request's tokens: they depend on the engine's count of requests so far."""
    [out] = engine.generate([[256, 1, 2, 3]], SamplingParams(max_tokens=16, temperature=50.0))
    return out.token_ids


def test_failed_generate_leaves_seed_derivation_unchanged():
    fresh = _sampled(_engine())
    engine = _engine()
    with pytest.raises(ValueError, match="empty"):
        engine.generate(["ok", ""], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", "", GREEDY)
    _unchanged(engine)
    assert _sampled(engine) == fresh


def test_generate_checks_its_arguments():
    engine = _engine()
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is empty"):
        engine.generate(["ok", ""], GREEDY)
    with pytest.raises(TypeError, match=r"prompts\[0\]: prompt\[1\]=1.5"):
        engine.generate([[256, 1.5]], GREEDY)
    with pytest.raises(TypeError, match="prompts"):
        engine.generate(5)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate(["a"], [GREEDY, GREEDY])
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate(["a", "b"], [GREEDY, "greedy"])
    _unchanged(engine)


# --- 6. cached prompt tokens never exceed the prompt ---------------------------------------
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_num_cached_tokens_counts_prompt_tokens_only_after_recompute_preemption(async_scheduling):
    # A tiny pool: requests are preempted after generating several full blocks, and their
    # re-admission hits blocks that hold generated tokens.
    engine = _engine(preemption_mode="recompute", async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    batch = prompts(4, seed=5, min_len=4, max_len=8)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    outs = _drain(engine)
    assert engine.kv_stats()["num_preemptions"] > 0
    assert any(o.num_preemptions for o in outs.values())
    for out in outs.values():
        assert 0 <= out.num_cached_tokens <= len(out.prompt_token_ids), out


# --- 7. prompt + output never exceed max_model_len ----------------------------------------
def test_prompt_of_max_model_len_tokens_is_rejected():
    engine = _engine()
    with pytest.raises(ValueError, match="prompt of 64 tokens leaves no room for output: "
                                         "max_model_len=64"):
        engine.add_request("r", [256] + [7] * 63, GREEDY)
    with pytest.raises(ValueError, match="prompt of 65 tokens"):
        engine.add_request("r", [7] * 65, GREEDY)
    _unchanged(engine)
    [out] = engine.generate([[256] + [7] * 62], GREEDY)
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


# --- 8, 9. EngineConfig: seed, booleans, integers -----------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(seed=-1), ValueError, "seed=-1"),
    (dict(seed="abc"), TypeError, "seed='abc'"),
    (dict(seed=1.5), TypeError, "seed=1.5"),
    (dict(seed=None), TypeError, "seed=None"),
    (dict(seed=True), TypeError, "seed=True"),
    (dict(enable_prefix_caching="no"), TypeError, "enable_prefix_caching='no'"),
    (dict(enable_prefix_caching=1), TypeError, "enable_prefix_caching=1"),
    (dict(debug_checks="no"), TypeError, "debug_checks='no'"),
    (dict(max_num_seqs=True), TypeError, "max_num_seqs=True"),
    (dict(block_size=2.0), TypeError, "block_size=2.0"),
    (dict(num_blocks=False), TypeError, "num_blocks=False"),
    (dict(quarantine_steps=1.0), TypeError, "quarantine_steps=1.0"),
    (dict(num_host_blocks=-1), ValueError, "num_host_blocks=-1"),
    (dict(max_model_len=0), ValueError, "max_model_len=0"),
    (dict(max_model_len=2**31), ValueError, "max_model_len"),
    (dict(kv_layout="pagged"), ValueError, "kv_layout='pagged' must be one of"),
    (dict(attention_impl="triton"), ValueError, "attention_impl='triton'"),
    (dict(model=None), TypeError, "model=None"),
])
def test_engine_config_rejects_bad_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        EngineConfig(**kwargs)


def test_engine_config_accepts_numpy_integers():
    c = EngineConfig(block_size=np.int64(8), seed=np.uint32(3), enable_prefix_caching=np.bool_(False))
    assert c.block_size == 8 and c.seed == 3


# --- 10. Engine: config type, attention impl vs backend -----------------------------------
@pytest.mark.parametrize("config", ["abc", 5, 0, {"block_size": 8}, SamplingParams()])
def test_engine_config_must_be_an_engine_config(config):
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(config)


def test_attention_impl_must_run_on_this_backend():
    backend = jax.default_backend()
    bad = next(i for i in ("pallas_tpu", "pallas_gpu") if i not in impls_for_backend(backend))
    cfg, params = small_model()
    with pytest.raises(ValueError, match=f"attention_impl='{bad}'.*backend is '{backend}'"):
        Engine(EngineConfig(attention_impl=bad), model_config=cfg, params=params)
    with pytest.raises(ValueError, match=r"needs a gpu or tpu backend.*'interpret'"):
        check_attention_impl("pallas", "cpu")
    check_attention_impl("pallas_gpu", "gpu")
    check_attention_impl("pallas", "tpu")
    assert set(impls_for_backend("cpu")) == {"auto", "xla", "reference", "interpret",
                                             "interpret_tpu", "interpret_gpu"}


# --- cache_salt: tenant isolation of the prefix cache --------------------------------------
SYSTEM = [256] + list(range(1, 40))  # 40 tokens: 5 full blocks of 8


def _hits(engine: Engine) -> int:
    return engine.kv_stats()["prefix_cache_hit_tokens"]


def _ask(engine: Engine, rid: str, suffix: list[int], salt=None):
    engine.add_request(rid, SYSTEM + suffix, GREEDY, cache_salt=salt)
    return _drain(engine)[rid]


def test_different_salts_never_share_prefix_blocks():
    plain = _engine()
    want = [_ask(plain, "a", [50]).token_ids, _ask(plain, "b", [60]).token_ids]
    assert _hits(plain) > 0  # unsalted requests share the system prompt

    engine = _engine()
    a = _ask(engine, "a", [50], salt="tenant-1")
    b = _ask(engine, "b", [60], salt=b"tenant-2")
    assert a.num_cached_tokens == b.num_cached_tokens == 0 and _hits(engine) == 0
    c = _ask(engine, "c", [60], salt="tenant-3")
    unsalted = _ask(engine, "d", [70])
    assert c.num_cached_tokens == unsalted.num_cached_tokens == 0 and _hits(engine) == 0
    assert [a.token_ids, b.token_ids] == want


def test_equal_salts_share_prefix_blocks():
    engine = _engine()
    a = _ask(engine, "a", [50], salt="tenant-1")
    b = _ask(engine, "b", [60], salt="tenant-1")
    c = _ask(engine, "c", [70], salt=b"tenant-1")  # a str salt is its UTF-8 bytes
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == c.num_cached_tokens == 40
    assert _hits(engine) == 80


def test_salt_survives_forks_and_recompute_preemption():
    """All requests under one salt behave exactly as unsalted ones: same outputs, same cache hits
    (a sample or a re-admission that lost the salt would miss its own cached blocks)."""
    def run(salt):
        engine = _engine(preemption_mode="recompute")
        batch = [SYSTEM[:16] + p for p in prompts(4, seed=7, min_len=3, max_len=6)]
        for i, p in enumerate(batch):
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=1 + i % 2)
            engine.add_request(f"r{i}", p, params, cache_salt=salt)
        outs = _drain(engine)
        return ({r: [s.token_ids for s in o.outputs] for r, o in outs.items()},
                _hits(engine), engine.kv_stats()["num_preemptions"])

    plain, salted = run(None), run("tenant-1")
    assert plain[2] > 0 and plain[1] > 0
    assert salted == plain


def test_engine_config_typo_names_the_closest_field():
    with pytest.raises(TypeError, match="no field 'max_num_seq'; closest: max_num_seqs"):
        EngineConfig(max_num_seq=4)
    from paged import SpeculativeConfig

    assert SpeculativeConfig.parse("ngram:3") == SpeculativeConfig("ngram", num_speculative_tokens=3)
    assert SpeculativeConfig.parse('{"method": "draft", "num_speculative_tokens": 2}') == \
        SpeculativeConfig("draft", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="METHOD"):
        SpeculativeConfig.parse("medusa:2")
