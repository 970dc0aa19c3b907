"""Prefill/decode disaggregation (``EngineConfig.prefill_replicas``, ``paged.fleet.handover``).

The multi-device checks are ``SCRIPT``, run by `test_forced_devices` in its one subprocess with
four forced host devices (``XLA_FLAGS`` must be set before JAX starts); the setting checks run
here.
"""

from __future__ import annotations

import pytest

from paged import EngineConfig, SpeculativeConfig

SCRIPT = r"""
import sys
sys.path.insert(0, "tests")
import jax
from engine_utils import prompts, small_model
from paged import Engine, EngineConfig, SamplingParams
from paged.kv.paging import next_pow2

assert len(jax.devices()) == 4, jax.devices()
cfg, params = small_model()
B = 8
base = dict(block_size=B, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
            attention_impl="xla", debug_checks=True, min_token_bucket=32, min_seq_bucket=4)
# M_KV of one token, written out: 2 (K and V) x layers x KV heads x head dim x 4 bytes (f32).
PER_TOKEN = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
shared = [256] + list(range(1, 25))  # three full blocks
reqs = prompts(4, seed=2) + [shared + [40 + i] for i in range(3)]
mixed = [greedy, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2),
         SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=2),
         SamplingParams(max_tokens=6, temperature=0.8), greedy, greedy, greedy]


def samples(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def run(conf, reqs, ps, warm=False):
    engine = Engine(conf, model_config=cfg, params=params)
    if warm:  # the hand-over's page buckets too; they write only null pages
        engine.warmup(logprobs=False, parallel_sampling=False)
    return engine, samples(engine.generate(reqs, ps))


def check(engine, prompt_of):
    # Every block comes back on both sides once the quarantine window has passed.
    for _ in range(3):
        engine.step()
    assert not engine.has_unfinished_requests()
    stats = engine.kv_stats()
    per = stats["replicas"]
    for r, e in zip(per, engine.replicas):
        assert r["num_free_blocks"] + r["num_cached_blocks"] == e.cache.num_pages - 1, r
        assert r["ledger"]["categories"]["transfer"] == 0, r
        if r["role"] == "prefill":  # counted: a prefill replica never decodes ...
            assert r["num_decode_tokens"] == r["num_recompute_tokens"] == 0, r
            assert r["num_prefill_tokens"] > 0, r
        else:  # ... and a decode replica never runs a prompt chunk
            assert r["role"] == "decode" and r["num_prefill_tokens"] == 0, r
    records = engine.handover.records
    for rec in records:  # bytes sent: exactly M_KV of the prompt tokens the decode side lacked
        assert rec.num_tokens == len(prompt_of[rec.request_id]), rec
        assert rec.bytes == PER_TOKEN * (rec.num_tokens - rec.hit_tokens), rec
        assert rec.num_pages == -(-(rec.num_tokens - rec.hit_tokens) // B), rec
        assert rec.wire_bytes == next_pow2(rec.num_pages) * B * PER_TOKEN, rec
        assert rec.hit_tokens % B == 0 and rec.seconds is not None, rec
    sent = sum(r["kv_transfer_bytes"] for r in per if r["role"] == "prefill")
    got = sum(r["kv_transfer_bytes"] for r in per if r["role"] == "decode")
    assert sent == got == sum(rec.bytes for rec in records) == stats["kv_transfer_bytes"]
    assert stats["num_handovers"] == len(records)
    return stats, records


_, single = run(EngineConfig(**base), reqs, mixed)

# P:D = 1:3 and 2:2: the single-device tokens (n = 2, seeded and unseeded sampling included),
# each request handed over once; prefix caching on both sides.
for p in (1, 2):
    engine, got = run(EngineConfig(**base, data_parallel_size=4, prefill_replicas=p), reqs, mixed,
                      warm=p == 2)
    assert got == single, (p, got, single)
    stats, records = check(engine, {f"gen0-{i}": q for i, q in enumerate(reqs)})
    assert [r["role"] for r in stats["replicas"]] == ["prefill"] * p + ["decode"] * (4 - p)
    assert sorted(rec.request_id for rec in records) == sorted(f"gen0-{i}" for i in range(7))
    assert all(rec.source < p <= rec.dest for rec in records), records
    assert set(engine.routed.values()) <= set(range(p))  # new requests go to prefill replicas
    hits = [rec.hit_tokens for rec in records]
    print("P", p, "decode-side hits", hits, "prefill-side hits",
          [r["prefix_cache_hit_tokens"] for r in stats["replicas"][:p]], flush=True)
    if p == 1:  # one decode replica served a shared prompt first; its twins hit there
        assert max(hits) == 24, hits

# P:D = 1:1 x TP 2 with a tight pool: the decode replica preempts (recompute there) and the
# prefill replica parks requests the decode side cannot take yet; tokens stay the one-device ones.
longer = prompts(8, seed=3, min_len=17, max_len=24)
grow = SamplingParams(max_tokens=22, temperature=0.0, ignore_eos=True)
tight = dict(base, num_blocks=9)
_, tight_single = run(EngineConfig(**tight), longer, grow)
engine = Engine(EngineConfig(**tight, data_parallel_size=2, tensor_parallel_size=2,
                             prefill_replicas=1), model_config=cfg, params=params)
for i, p in enumerate(longer):
    engine.add_request(f"t{i}", p, grow)
outs, parked, held = {}, 0, 0
while engine.has_unfinished_requests():
    outs.update((o.request_id, o) for o in engine.step() if o.finished)
    parked = max(parked, engine.handover.num_parked)
    held = max(held, engine.kv_stats()["replicas"][0]["ledger"]["categories"]["transfer"])
assert [outs[f"t{i}"].outputs[0].token_ids for i in range(8)] == [t[0] for t in tight_single]
stats, records = check(engine, {f"t{i}": q for i, q in enumerate(longer)})
dec = stats["replicas"][1]
print("TP2 parked", parked, "held bytes", held, "decode preemptions", dec["num_preemptions"],
      "recompute tokens", dec["num_recompute_tokens"], flush=True)
assert parked > 0 and held > 0 and dec["num_preemptions"] > 0 and dec["num_recompute_tokens"] > 0
assert all(len(e.cache.k_pages.sharding.device_set) == 2 for e in engine.replicas)

# Aborts before (prefilling), during (parked; pages in flight) and after (decoding) a hand-over.
long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
many = prompts(8, seed=5, min_len=4, max_len=20)
_, want = run(EngineConfig(**base), many, long)
engine = Engine(EngineConfig(**base, data_parallel_size=2, prefill_replicas=1),
                model_config=cfg, params=params)
for i, p in enumerate(many):
    engine.add_request(f"r{i}", p, long)
aborted, outs = {}, {}
assert engine.abort("r7")  # before: still waiting on the prefill replica
aborted["before"] = "r7"
while engine.has_unfinished_requests():
    n = len(engine.handover.records)
    outs.update((o.request_id, o) for o in engine.step() if o.finished)
    if "in_flight" not in aborted and len(engine.handover.records) > n \
            and engine.handover.held_seq_ids(0):
        rid = engine.handover.records[-1].request_id  # its pages may still be on their way
        assert engine.replica_of(rid) == 1 and engine.abort(rid)
        aborted["in_flight"] = rid
    parked = [r for r in engine.handover.parked_request_ids() if r not in aborted.values()]
    if "parked" not in aborted and parked:
        assert engine.replica_of(parked[0]) == 0 and engine.abort(parked[0])
        aborted["parked"] = parked[0]
    if "after" not in aborted and "parked" in aborted:
        busy = [r for r in engine.unfinished_request_ids() if engine.replica_of(r) == 1
                and r not in aborted.values()]
        if busy:
            assert engine.abort(busy[0])
            aborted["after"] = busy[0]
print("aborted", aborted, flush=True)
assert sorted(aborted) == ["after", "before", "in_flight", "parked"], aborted
for i in range(8):
    o = outs[f"r{i}"]
    if f"r{i}" in aborted.values():
        assert o.outputs[0].finish_reason == "abort", o
    else:
        assert o.outputs[0].token_ids == want[i][0], (i, o)
check(engine, {f"r{i}": q for i, q in enumerate(many)})

# Quantized pages move with their scales (int8 values, one float32 scale per page and KV head).
quant = dict(base, kv_cache_dtype="int8", kv_scale_granularity="page")
_, want = run(EngineConfig(**quant), reqs, mixed)
engine, got = run(EngineConfig(**quant, data_parallel_size=2, prefill_replicas=1), reqs, mixed)
assert got == want, (got, want)
per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # 1-byte values
per_page_scales = 2 * cfg.num_layers * cfg.num_kv_heads * 4
for rec in engine.handover.records:
    n = rec.num_tokens - rec.hit_tokens
    assert rec.bytes == n * per_token + -(-n // B) * per_page_scales, rec
    assert rec.wire_bytes == next_pow2(rec.num_pages) * (B * per_token + per_page_scales), rec

# Colocated replicas (prefill_replicas=0) do both and move nothing.
engine, got = run(EngineConfig(**base, data_parallel_size=2), reqs, mixed)
assert got == single and engine.handover is None
for r in engine.kv_stats()["replicas"]:
    assert r["role"] == "both" and r["kv_transfer_bytes"] == 0, r
    assert r["num_prefill_tokens"] > 0 and r["num_decode_tokens"] > 0, r
print("DISAGG_OK")
"""


@pytest.mark.parametrize("kw, exc, match", [
    (dict(data_parallel_size=2, prefill_replicas=2), ValueError, "must be < data_parallel_size"),
    (dict(prefill_replicas=1), ValueError, "must be < data_parallel_size=1"),
    (dict(data_parallel_size=2, prefill_replicas=-1), ValueError, "prefill_replicas"),
    (dict(data_parallel_size=2, prefill_replicas=True), TypeError, "prefill_replicas"),
    (dict(data_parallel_size=2, prefill_replicas=1, kv_layout="contiguous"), ValueError,
     "needs kv_layout='paged'"),
    (dict(data_parallel_size=2, prefill_replicas=1, scheduling="static"), ValueError,
     "needs scheduling='continuous'"),
    (dict(data_parallel_size=2, prefill_replicas=1,
          speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2)), ValueError,
     "needs speculative=None"),
])
def test_bad_disaggregation_settings_are_refused(kw, exc, match):
    with pytest.raises(exc, match=match):
        EngineConfig(**kw)



def test_engine_core_processes_refuse_prefill_replicas():
    from paged.server.core_replicas import CoreReplicas

    with pytest.raises(ValueError, match="prefill_replicas=1 needs the replicas in one process"):
        CoreReplicas(EngineConfig(data_parallel_size=2, prefill_replicas=1))
