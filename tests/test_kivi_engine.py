"""The engine serving packed KV (int4 / int2, KIVI): tokens equal a dense no-cache run over the
same quantize-on-fill semantics (``pallas_kernels.kivi.dense_on_fill``) with chunked prefill,
prefix caching, copy-on-write (n=4), preemption by recompute and by swap, async scheduling and
NaN poisoning on; the GPU-style kernel (interpret) giving the XLA path's tokens;
one layer's step against the exact K/V (closed pages bit-equal to quantizing the exact page, the
open page exact, its head bit for bit in its pool page's value bytes); which open-page slots a
step writes back and reclaims; the ledger's bytes against ``paged.accounting``; bad settings at
construction."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import greedy_reference, prompts, small_model
from jit_utils import jit_call

from paged import Engine, EngineConfig, SamplingParams
from paged.accounting.formulas import ModelSpec
from paged.kv.open_pages import NO_PAGE, OpenPages
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


@pytest.mark.parametrize("dt, async_scheduling, preemption_mode", [
    ("int4", False, "recompute"), ("int2", True, "swap")])
def test_tokens_equal_the_quantize_on_fill_reference(dt, async_scheduling, preemption_mode):
    cfg, params = _model()
    engine = _engine(dt, async_scheduling=async_scheduling, preemption_mode=preemption_mode)
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
    assert (stats["num_swap_outs"] > 0) == (preemption_mode == "swap")
    assert stats["prefix_cache_hit_tokens"] > 0


def test_gpu_style_kernel_gives_the_xla_tokens():
    # The engine with the GPU-style Pallas kernel (interpret mode) reading the closed int4 pages:
    # chunked prefill, decodes, a repeated prompt (prefix hit): the same tokens as the XLA path.
    ps = prompts(3, seed=7, min_len=6, max_len=13)
    ps = ps + ps[:1]
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    out = {}
    for impl in ("xla", "interpret_gpu"):
        engine = _engine("int4", attention_impl=impl, debug_checks=False)
        out[impl] = [o.outputs[0].token_ids for o in engine.generate(ps, sp)]
    assert engine.kv_stats()["prefix_cache_hit_tokens"] > 0
    assert out["interpret_gpu"] == out["xla"]


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


_attend = jax.jit(kivi_attention.attend, static_argnames=("layer", "sm_scale", "soft_cap",
                                                          "impl"))
_dense_on_fill = jax.jit(kivi.dense_on_fill, static_argnames=("bits", "page_size", "sm_scale"))


@pytest.mark.parametrize("bits", [4, 2])
def test_one_layer_closes_pages_bit_exact_and_keeps_the_open_page_exact(bits):
    # Two sequences over two steps: A prefills 6 then 5 tokens (pages close mid-chunk), B
    # prefills 3 then decodes 1 (its page closes on the decode). Outputs equal dense_on_fill's;
    # closed pages are bit-equal to quantizing the exact page; the open page holds exact K/V.
    p, hkv, hq, d, slots = BLOCK, 2, 4, 16, 2
    rng = np.random.default_rng(bits)
    lens = {"A": 11, "B": 4}
    qkv = {s: [rng.standard_normal((n, h, d)).astype(np.float32) for h in (hq, hkv, hkv)]
           for s, n in lens.items()}
    tables = {"A": [3, 5, 1, 0], "B": [2, 4, 0, 0]}
    shape = (1, hkv, 8, p, d)
    pools = [packed.zeros(shape, bits, per) for per in ("channel", "token")]
    tail = p * d - p * d * bits // 8 // 4  # float32 elements past the head
    opens = [jnp.zeros((1, hkv, slots, tail), jnp.float32) for _ in range(2)]
    owner = OpenPages(slots, p, lambda page: True)
    sm = d**-0.5
    for starts, q_lens in (((0, 0), (6, 3)), ((6, 3), (5, 1))):
        kv_lens = [a + b for a, b in zip(starts, q_lens)]
        md, _, _ = build_metadata(kv_lens, q_lens, [tables["A"], tables["B"]], page_size=p,
                                  num_tokens=16, max_num_seqs=2, pages_per_seq=4)
        md = md.replace(kivi=kivi_attention.KiviMeta(**owner.plan(
            md.kv_lens, md.cu_q_lens, md.page_indices, 2, 16)))
        rows = [np.concatenate([qkv[s][i][a:a + n] for s, a, n in zip("AB", starts, q_lens)])
                for i in range(3)]
        rows = [jnp.asarray(np.pad(x, ((0, 16 - len(x)), (0, 0), (0, 0)))) for x in rows]
        out, kp, vp = _attend(
            *rows, *(kivi_attention.KiviPages(pl, op) for pl, op in zip(pools, opens)), md,
            layer=0, sm_scale=sm, soft_cap=None, impl="xla")
        pools, opens = [kp.pool, vp.pool], [kp.open, vp.open]
        r = 0
        for s, a, n in zip("AB", starts, q_lens):
            q, k, v = (jnp.asarray(x[None, :a + n]) for x in qkv[s])
            want = _dense_on_fill(q, k, v, bits=bits, page_size=p, sm_scale=sm)[0, a:]
            np.testing.assert_allclose(np.asarray(out[r:r + n]), np.asarray(want), atol=2e-5)
            r += n
    for s, n in lens.items():
        for side, (pool, per, x) in enumerate(zip(pools, ("channel", "token"), qkv[s][1:])):
            for j in range(n // p):  # closed pages: exactly the quantized exact page
                want = jit_call(packed.quantize_pages, np.swapaxes(x[j * p:(j + 1) * p], 0, 1),
                                bits=bits, per=per)
                page = tables[s][j]
                for got, w in ((pool.values, want.values), (pool.scale, want.scale),
                               (pool.zero, want.zero)):
                    np.testing.assert_array_equal(np.asarray(got[0, :, page]), np.asarray(w))
            if n % p:  # the open page: exact, its head in its pool page, its tail in its slot
                slot = owner.slot_of[tables[s][n // p]]
                whole = kivi_attention.open_pages(kivi_attention.KiviPages(pool, opens[side]), 0,
                                                  owner.slot_pages())
                got = np.asarray(whole[:, slot, :n % p])
                np.testing.assert_array_equal(got, np.swapaxes(x[n // p * p:], 0, 1))
                # the head is the pool page's value bytes, bit for bit (no second copy)
                e = p * d * bits // 8 // 4
                raw = np.asarray(pool.values[0, :, tables[s][n // p]]).reshape(hkv, -1)
                head = np.swapaxes(x[n // p * p:], 0, 1).reshape(hkv, -1)[:, :e]
                np.testing.assert_array_equal(raw[:, :head.shape[1] * 4].view(np.float32), head)


def test_only_slots_written_in_the_step_store_their_head_back():
    # A slot whose page is no longer in use keeps its mapping (stale); its page may hold another
    # sequence's closed page by now, so no step writes that slot's head back to it.
    live = {5, 6}
    owner = OpenPages(2, BLOCK, lambda page: page in live)
    table = np.array([[5, 0], [6, 0]], np.int32)
    meta = owner.plan(np.array([2, 3]), np.array([0, 2, 5]), table, 2, 8)  # both open a page
    s5, s6 = owner.slot_of[5], owner.slot_of[6]
    assert list(meta["slot_write"][[s5, s6]]) == [5, 6]
    live.discard(5)  # page 5's sequence left; page 5 now closes for a new sequence
    meta = owner.plan(np.array([4, 4]), np.array([0, 4, 5]), np.array([[5, 0], [6, 0]]), 2, 8)
    assert meta["slot_page"][s5] == 5 and meta["slot_page"][s6] == 6  # heads read at the start
    assert list(meta["close_dst"][:2]) == [5, 6]
    assert list(meta["slot_write"]) == [NO_PAGE, NO_PAGE]  # both pages closed: nothing written
    meta = owner.plan(np.array([1]), np.array([0, 1]), np.array([[7, 0]]), 1, 8)
    assert list(meta["slot_write"]).count(7) == 1 and NO_PAGE in meta["slot_write"]


def test_a_stale_slot_of_a_page_handed_out_again_is_reclaimed():
    # Page 5 was a finished sequence's open page; it is handed out again (new version) as a page
    # of a prompt whose chunks have not reached it: in use, but its slot is stale. The slot is
    # reclaimed for the next open page instead of running out (the engine's capacity study hit
    # this with one slot per running sequence).
    version = {5: 1, 6: 1}
    owner = OpenPages(1, BLOCK, lambda page: True, version.get)
    owner.plan(np.array([2]), np.array([0, 2]), np.array([[5, 0]]), 1, 8)
    assert owner.num_held == 1
    version[5] = 2
    assert owner.num_held == 0
    meta = owner.plan(np.array([1]), np.array([0, 1]), np.array([[6, 0]]), 1, 8)
    assert owner.slot_of == {6: 0} and meta["slot_write"][0] == 6 and owner.num_held == 1


def test_kv_stats_bytes_match_the_accounting_formulas():
    cfg, _ = _model()
    engine = _engine("int4", max_num_batched_tokens=16, debug_checks=False)
    spec = ModelSpec.from_model_config(cfg, dtype="float32", kv_cache_dtype="int4")
    lens = (5, 7)  # both end in an open page
    for i, n in enumerate(lens):
        engine.add_request(f"r{i}", list(range(1, n + 1)),
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # both prompts prefilled: KV of 5 and 7 tokens
    stats = engine.kv_stats()
    ledger = stats["ledger"]
    assert ledger["pool_bytes"] == engine.cache.nbytes == 20 * spec.bytes_per_block(BLOCK)
    assert ledger["categories"]["scales"] == engine.cache.scale_nbytes > 0
    assert ledger["side_costs"]["open_page_bytes"] == engine.cache.open_nbytes \
        == 6 * spec.open_page_bytes(BLOCK)
    assert stats["num_used_blocks"] == 4 and ledger["open_pages"]["held"] == 2
    held = stats["num_used_blocks"] * ledger["bytes_per_block"] + ledger["open_pages"]["held_bytes"]
    assert held == sum(spec.sequence_bytes(n, BLOCK) for n in lens)
    per_token = spec.value_bytes_per_block(BLOCK) // BLOCK  # 2 * L * Hkv * D * 4 bits / 8
    assert ledger["categories"]["effective_kv"] == sum(lens) * per_token
    assert ledger["categories"]["tail_fragmentation"] == (4 * BLOCK - sum(lens)) * per_token


@pytest.mark.parametrize("kw, match", [
    (dict(kv_cache_dtype="int4", attention_impl="pallas"), "attention_impl"),
    (dict(kv_cache_dtype="int2", attention_impl="interpret_tpu"), "attention_impl"),
    (dict(kv_cache_dtype="int4", tensor_parallel_size=2), r"packed_kv \+ tensor_parallel"),
    (dict(kv_cache_dtype="int2", cascade_attention="on"), r"packed_kv \+ cascade"),
    (dict(kv_cache_dtype="int4", kv_layout="contiguous"), r"packed_kv \+ contiguous_layout"),
])
def test_bad_settings_are_refused_by_the_config(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


@pytest.mark.parametrize("dt, head_dim, block_size, match", [
    ("int2", 6, 4, "head_dim=6 must be a multiple of 4"),
    ("int4", 16, 1, "block_size=1 must be >= 2"),
])
def test_pages_that_do_not_pack_are_refused_at_construction(dt, head_dim, block_size, match):
    cfg = LlamaConfig(vocab_size=258, d_model=24, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=head_dim, ffn_dim=32, max_seq_len=64)
    config = EngineConfig(kv_cache_dtype=dt, block_size=block_size, num_blocks=80,
                          max_model_len=64, max_num_seqs=2, attention_impl="xla")
    with pytest.raises(ValueError, match=match):
        Engine(config, model_config=cfg, params=init_params(cfg, 0))


def test_the_host_tier_moves_packed_pages():
    # Six 20-token prefixes (30 pages of 4: more than the pool) sent in three rounds with new
    # suffixes: later rounds load evicted prefixes from the host tier. Tokens equal the run
    # without the tier (which equals the reference, above); the tier moved packed pages.
    pre = prompts(6, seed=1, min_len=19, max_len=20)
    turns = [[p + [r + 1, i + 7, 3] for i, p in enumerate(pre)] for r in range(3)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = {}
    for host in (0, 1 << 20):
        engine = _engine("int4", num_blocks=20, max_num_seqs=3, max_num_batched_tokens=32,
                         min_token_bucket=32, min_seq_bucket=4, host_kv_cache_bytes=host)
        out[host] = [o.outputs[0].token_ids for t in turns for o in engine.generate(t, sp)]
    tier = engine.kv_stats()["host_tier"]
    assert tier["loaded_blocks"] > 0 and tier["offloaded_blocks"] > 0
    assert out[1 << 20] == out[0]
