"""Data-parallel replicas and tensor parallel through ``EngineConfig`` (``paged.engine.data_parallel``).

The multi-device checks are ``SCRIPT``, run by `test_forced_devices` in its one subprocess with
four forced host devices (``XLA_FLAGS`` must be set before JAX starts); the argument checks run
here on the one CPU device.
"""

from __future__ import annotations

import jax
import pytest
from engine_utils import small_model

from paged import Engine, EngineConfig

SCRIPT = r"""
import sys
sys.path.insert(0, "tests")
import jax
from engine_utils import prompts, small_model
from paged import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from paged.engine.data_parallel import DataParallelEngine

assert len(jax.devices()) == 4, jax.devices()
cfg, params = small_model()
# One token bucket and one sequence bucket: each replica compiles one step shape per device.
base = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
            attention_impl="xla", debug_checks=True, min_token_bucket=32, min_seq_bucket=4)
sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
shared = [256] + list(range(1, 25))  # three full blocks of 8
batch = prompts(5, seed=2) + [shared + [40 + i] for i in range(3)]


def run(conf, reqs=batch, p=sp):
    engine = Engine(conf, model_config=cfg, params=params)
    return engine, [o.token_ids for o in engine.generate(reqs, p)]


_, single = run(EngineConfig(**base))
# Two admitted sequences per replica outgrow 8 blocks while they decode.
longer, grow = prompts(8, seed=3, min_len=17, max_len=24), SamplingParams(
    max_tokens=22, temperature=0.0, ignore_eos=True)
_, tight_single = run(EngineConfig(**base, num_blocks=9), longer, grow)
for d, t in ((4, 1), (2, 2)):
    engine, got = run(EngineConfig(**base, data_parallel_size=d, tensor_parallel_size=t))
    assert isinstance(engine, DataParallelEngine) and len(engine.replicas) == d
    assert got == single, (d, t, got, single)
    pages = [r.cache.k_pages.sharding for r in engine.replicas]
    assert all(len(s.device_set) == t for s in pages), pages
    assert len(set().union(*(s.device_set for s in pages))) == d * t  # no device shared
    q = engine.replicas[0].params["params"]["layers_0"]["attn"]["q_proj"].sharding
    assert (tuple(q.spec)[1:2] == ("model",)) == (t > 1), q
    stats = engine.kv_stats()
    per = stats["replicas"]
    assert sum(r["num_requests_served"] for r in per) == len(batch) == stats["num_requests_served"]
    assert all(r["num_requests_served"] > 0 for r in per), per  # every replica served
    # Where each request went stays on record after it finished (studies read it).
    assert sorted(engine.routed) == sorted(f"gen0-{i}" for i in range(len(batch)))
    for i in range(d):
        assert list(engine.routed.values()).count(i) == per[i]["num_requests_served"]
    assert not engine.has_unfinished_requests() and not engine.has_step_in_flight()
    assert stats["num_free_blocks"] == sum(r["num_free_blocks"] for r in per)
    assert stats["block_size"] == 8 and stats["data_parallel_size"] == d
    # Preemption: a pool of 8 usable blocks per replica cannot hold its share at once.
    engine, got = run(EngineConfig(**base, num_blocks=9, data_parallel_size=d,
                                   tensor_parallel_size=t, preemption_mode="swap" if t > 1 else "recompute"),
                      longer, grow)
    assert got == tight_single, (d, t, got, tight_single)
    print(d, t, "preemptions", engine.kv_stats()["num_preemptions"], flush=True)
    assert engine.kv_stats()["num_preemptions"] > 0

# Seeds are engine-wide (not per replica), so sampled tokens do not depend on routing either;
# speculation and parallel sampling compose with replicas.
mixed = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2),
         SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=2),
         SamplingParams(max_tokens=8, temperature=0.8)]
rep = [p * 3 for p in prompts(3, seed=3, min_len=4, max_len=9)]
samples = lambda e: [[c.token_ids for c in o.outputs] for o in e.generate(rep, mixed)]
want = samples(Engine(EngineConfig(**base), model_config=cfg, params=params))
spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
engine = Engine(EngineConfig(**base, data_parallel_size=2), model_config=cfg, params=params)
assert samples(engine) == want
engine = Engine(EngineConfig(**base, data_parallel_size=2, speculative=spec), model_config=cfg,
                params=params)
got = samples(engine)
assert got[0] == want[0] and engine.spec_decode_stats()["num_drafts"] > 0  # greedy: identical

# Routing: after a warm-up that puts each system prompt on one replica, prefix-aware routing
# sends every follow-up where its prompt is cached; round robin spreads them. Nothing here is
# random (routing reads queue sizes and prefix indexes, decoding is greedy), so the margin is
# not statistical: prefix-aware hits all 12 follow-ups (12 x 3 blocks x 8 tokens = 288); round
# robin hits only where rotation happens to land on a replica holding the prompt (96 here), and
# the assertion leaves it room up to half of prefix-aware's.
systems = [[256] + [10 * s + 1] * 24 for s in range(4)]
hits = {}
for policy in ("prefix_aware", "round_robin"):
    engine = Engine(EngineConfig(**base, data_parallel_size=4, router=policy),
                    model_config=cfg, params=params)
    engine.generate(systems, sp)
    warm = engine.kv_stats()["prefix_cache_hit_tokens"]
    for wave in range(3):
        engine.generate([systems[(i + wave) % 4] + [100 + i, wave] for i in range(4)], sp)
    hits[policy] = engine.kv_stats()["prefix_cache_hit_tokens"] - warm
print("hits", hits, flush=True)
assert hits["prefix_aware"] == 12 * 24, hits  # every follow-up hits its 3 blocks
assert hits["prefix_aware"] >= 2 * hits["round_robin"], hits

# Abort and timeout free blocks on the replica that held them; nothing is lost or leaked.
engine = Engine(EngineConfig(**base, data_parallel_size=2, router="round_robin"),
                model_config=cfg, params=params)
free0 = [r.block_manager.num_free_blocks for r in engine.replicas]
long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
engine.add_request("a", batch[0], long)
engine.add_request("b", batch[1], long, timeout_s=0.05)
assert (engine.replica_of("a"), engine.replica_of("b")) == (0, 1)
engine.step(); engine.step()
assert all(r.block_manager.num_free_blocks < f for r, f in zip(engine.replicas, free0))
assert engine.abort("a") and not engine.abort("nope")
import time
time.sleep(0.06)
outs = {}
while engine.has_unfinished_requests() or engine.has_step_in_flight():
    outs.update((o.request_id, o) for o in engine.step() if o.finished)
assert outs["a"].outputs[0].finish_reason == "abort", outs["a"]
assert outs["b"].outputs[0].finish_reason == "timeout", outs["b"]
for _ in range(3):
    engine.step()  # the quarantine window passes
assert [r.block_manager.num_free_blocks + r.block_manager.num_cached_blocks
        for r in engine.replicas] == free0
assert engine.replica_of("a") is None
print("DP_OK")
"""


@pytest.mark.parametrize("kw, match", [
    (dict(data_parallel_size=2), r"data_parallel_size=2 x tensor_parallel_size=1 = 2 devices, "
                                 r"but only 1"),
    (dict(tensor_parallel_size=3), r"3 devices, but only 1"),
])
def test_too_many_devices_is_refused(kw, match):
    cfg, params = small_model()
    with pytest.raises(ValueError, match=match):
        Engine(EngineConfig(max_model_len=64, **kw), model_config=cfg, params=params)


def test_kv_heads_must_divide_by_tensor_parallel_size():
    cfg, params = small_model()  # 2 KV heads
    devices = jax.devices() * 3  # enough entries for the count check to pass
    with pytest.raises(ValueError, match=r"num_kv_heads=2 is not divisible by "
                                         r"tensor_parallel_size=3"):
        Engine(EngineConfig(max_model_len=64, tensor_parallel_size=3), model_config=cfg,
               params=params, devices=devices)


@pytest.mark.parametrize("kw, err", [
    (dict(data_parallel_size=0), ValueError), (dict(tensor_parallel_size=True), TypeError),
    (dict(router="random"), ValueError), (dict(router_load_threshold=-1), ValueError),
])
def test_bad_parallel_settings(kw, err):
    with pytest.raises(err):
        EngineConfig(**kw)


# Run by test_forced_devices: replicas whose host half steps in a process of its own
# (paged.server.replica_process) give the in-process engine's tokens, routes and batches.
PROCESS_REPLICAS_SCRIPT = r"""
import sys
sys.path.insert(0, "tests")
from engine_utils import prompts, small_model
from paged import Engine, EngineConfig, SamplingParams
from paged.engine.device_step import stub_step
from paged.server.replica_process import process_replicas

cfg, params = small_model()
base = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
            attention_impl="xla", debug_checks=True, min_token_bucket=32, min_seq_bucket=4,
            data_parallel_size=2)
shared = [256] + list(range(1, 25))
batch = prompts(5, seed=2) + [shared + [40 + i] for i in range(3)]
mixed = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2),
         SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=2),
         SamplingParams(max_tokens=8, temperature=0.8), SamplingParams(max_tokens=8)] * 2
engines = [Engine(EngineConfig(**base), model_config=cfg, params=params),
           process_replicas(EngineConfig(**base), model_config=cfg, params=params)]
records = [e.record_steps() for e in engines]
got = [[[c.token_ids for c in o.outputs] for o in e.generate(batch, mixed)] for e in engines]
assert got[0] == got[1], got
assert records[0] == records[1] and len(records[0]) > 1
assert engines[0].routed == engines[1].routed and len(set(engines[1].routed.values())) == 2
stats = [e.kv_stats() for e in engines]
for key in ("num_requests_served", "prefix_cache_hit_tokens", "num_free_blocks"):
    assert stats[0][key] == stats[1][key], (key, stats)
engine = engines[1]
engine.add_request("a", batch[0], SamplingParams(max_tokens=30, ignore_eos=True))
engine.step(); engine.step()
assert engine.abort("a") and not engine.abort("nope")
outs = []
while engine.has_unfinished_requests():
    outs += engine.step()
assert outs[-1].request_id == "a" and outs[-1].outputs[0].finish_reason == "abort", outs
engine.set_device_step(stub_step)  # pickled by reference into each replica's process
out = engine.generate([batch[1]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
assert out.token_ids == [0] * 5, out.token_ids
for r in engine.replicas:
    r.close()
print("PROCESS_REPLICAS_OK")
"""
