"""Hugging Face checkpoints: the engine's greedy tokens equal transformers', tokenizers round-trip.

The fixtures under ``tests/fixtures/hf/`` were written by transformers
(``experiments/make_hf_fixtures.py``), with its float32 no-cache greedy continuations in each
``expected.json``; nothing here needs torch or transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from paged import Engine, EngineConfig, SamplingParams
from paged.accounting import ModelSpec
from paged.models import (
    ByteTokenizer,
    IncrementalDecoder,
    load_checkpoint,
    load_tokenizer,
)
from paged.models.hf_tokenizer import HFTokenizer, TokenIdsOnly

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
NAMES = ("llama", "llama3_bf16", "llama_sharded", "qwen2", "mistral", "bpe")
MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "experiments" / "model_configs"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# One token bucket and one sequence bucket: a single compilation per engine keeps the file fast.
FAST = {"max_model_len": 256, "max_num_seqs": 8, "min_seq_bucket": 8, "max_num_batched_tokens": 512,
            "min_token_bucket": 512}
MULTIBYTE = "東京は日本の首都です。🚀 Café 北京欢迎你 👍🏽 ❤️ 🇯🇵 서울"


def expected(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def _prompts(record: dict) -> list:
    # Text where the fixture has it (so the engine's encode path is exercised), else token ids.
    return [p.get("text") or p["ids"] for p in record["prompts"]]


def _check_greedy(outs, record: dict) -> None:
    for i, (out, want) in enumerate(zip(outs, record["prompts"], strict=True)):
        assert out.outputs[0].token_ids == want["greedy"], (record["fixture"], i, len(want["ids"]))


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(name):
    record = expected(name)
    engine = Engine(EngineConfig(model=str(FIXTURES / name), **FAST))
    outs = engine.generate(_prompts(record), GREEDY)
    _check_greedy(outs, record)
    assert [len(o.prompt_token_ids) for o in outs] == [len(p["ids"]) for p in record["prompts"]]
    if name == "bpe":
        assert isinstance(engine.tokenizer, HFTokenizer)
        assert [o.outputs[0].text for o in outs] == [p["greedy_text"] for p in record["prompts"]]
    else:
        assert isinstance(engine.tokenizer, TokenIdsOnly)
    if name in ("qwen2", "bpe"):  # the same prompts again: served from the prefix cache
        hits = engine.kv_stats()["prefix_cache_hit_tokens"]
        _check_greedy(engine.generate(_prompts(record), GREEDY), record)
        assert engine.kv_stats()["prefix_cache_hit_tokens"] > hits


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_under_preemption_and_prefix_caching(mode):
    """A pool of 20 blocks of 16 holds about half the batch: sequences are preempted and come
    back (twice over, the second round with whatever the prefix cache kept). Tokens never
    change."""
    record = expected("qwen2")
    engine = Engine(EngineConfig(model=str(FIXTURES / "qwen2"), num_blocks=20, block_size=16,
                                 preemption_mode=mode, enable_prefix_caching=True, **FAST))
    _check_greedy(engine.generate(_prompts(record), GREEDY), record)
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0
    _check_greedy(engine.generate(_prompts(record), GREEDY), record)


def test_text_encodes_as_the_tokenizers_library_and_decodes_back():
    tok = load_tokenizer(FIXTURES / "bpe", 384)
    raw = Tokenizer.from_file(str(FIXTURES / "bpe" / "tokenizer.json"))
    texts = [p["text"] for p in expected("bpe")["prompts"] if p.get("text")]
    for text, want in zip(texts, [p["ids"] for p in expected("bpe")["prompts"] if p.get("text")]):
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids == want  # want: transformers' AutoTokenizer ids
        assert tok.decode(ids) == text
    ids = tok.encode(MULTIBYTE)
    assert ids[0] == tok.bos_id == 1 and tok.decode(ids) == MULTIBYTE
    assert tok.encode(MULTIBYTE, add_bos=False) == ids[1:]
    # generation_config.json's list wins over config.json's single eos_token_id
    assert tok.eos_ids == (2, 3) and tok.eos_id == 2 and tok.vocab_size == 384


@pytest.mark.parametrize("tok", [load_tokenizer(FIXTURES / "bpe", 384), ByteTokenizer()],
                         ids=["bpe", "bytes"])
def test_incremental_decoder_never_splits_a_character(tok):
    ids = tok.encode(MULTIBYTE)
    rng = np.random.default_rng(0)
    for chunked in (False, True):
        dec = IncrementalDecoder(tok, ids[:1])
        pieces, i = [], 1
        while i < len(ids):
            k = int(rng.integers(1, 4)) if chunked else 1
            pieces.append(dec.step(ids[i:i + k]))
            i += k
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) + dec.flush() == tok.decode(ids[1:]) == MULTIBYTE
        assert "" in pieces  # some tokens were held back: they ended mid-character
    # Text that really is broken UTF-8 (a random model's output) still adds up at the end.
    greedy = expected("bpe")["prompts"][3]["greedy"]
    if isinstance(tok, ByteTokenizer):
        greedy = [t % 256 for t in greedy]
    dec = IncrementalDecoder(tok)
    assert "".join(dec.step([t]) for t in greedy) + dec.flush() == tok.decode(greedy)


def test_checkpoint_without_tokenizer_takes_token_ids_only():
    engine = Engine(EngineConfig(model=str(FIXTURES / "llama"), **FAST))
    assert engine.tokenizer.eos_id == 2  # generation_config.json
    with pytest.raises(ValueError, match="tokenizer.json"):
        engine.add_request("r", "hello")
    assert not engine.has_unfinished_requests()


def test_load_checkpoint_dtypes_and_layout():
    config, params = load_checkpoint(FIXTURES / "llama3_bf16", dtype="bfloat16")
    assert config.dtype == "bfloat16" and config.rope_scaling == "llama3"
    assert config.head_dim == 24 and config.num_kv_heads == 1
    leaves = jax.tree.leaves(params)
    assert {str(x.dtype) for x in leaves} == {"bfloat16"}
    assert all(isinstance(x, np.ndarray) for x in leaves)  # host arrays: no device memory
    config, params = load_checkpoint(FIXTURES / "llama_sharded")  # float16, two shards, tied
    assert config.tie_embeddings and "lm_head" not in params["params"]
    assert params["params"]["embedding"].dtype == np.float32
    config, params = load_checkpoint(FIXTURES / "qwen2")
    assert config.qkv_bias and params["params"]["layers_0"]["attn"]["q_bias"].shape == (4, 16)


def test_head_dim_defaults_to_hidden_over_heads(tmp_path):
    ckpt = _copy(tmp_path, "llama")
    _edit_config(ckpt, head_dim=None)
    assert load_checkpoint(ckpt)[0] == load_checkpoint(FIXTURES / "llama")[0]


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _edit_config(ckpt: Path, **changes) -> None:
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def _rewrite(ckpt: Path, edit) -> None:
    from safetensors.numpy import load_file

    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _bad_missing_dir(tmp_path):
    return tmp_path / "nope", "nope"


def _bad_architecture(tmp_path):
    ckpt = _copy(tmp_path, "llama")
    _edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    return ckpt, r"config\.json: architectures=\['GPT2LMHeadModel'\]"


def _bad_truncated(tmp_path):
    ckpt = _copy(tmp_path, "llama")
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return ckpt, r"model\.safetensors: not a readable safetensors file"


def _bad_shape(tmp_path):
    ckpt = _copy(tmp_path, "llama")
    _rewrite(ckpt, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": np.zeros((64, 64),
                                                                                     np.float32)}))
    return ckpt, r"model\.safetensors: key 'model\.layers\.1\.mlp\.up_proj\.weight' has shape"


def _bad_absent_key(tmp_path):
    ckpt = _copy(tmp_path, "llama")
    _rewrite(ckpt, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    return ckpt, r"model\.safetensors: key 'model\.layers\.0\.self_attn\.k_proj\.weight' is missing"


def _bad_missing_shard(tmp_path):
    ckpt = _copy(tmp_path, "llama_sharded")
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    return ckpt, r"index\.json: shard 'model-00002-of-00002\.safetensors'"


def _bad_sliding_window(tmp_path):  # shorter than a page (block_size 16)
    ckpt = _copy(tmp_path, "mistral")
    _edit_config(ckpt, sliding_window=8)
    return ckpt, r"sliding_window=8 is shorter than a page \(block_size=16\)"


def _bad_layer_types(tmp_path):
    ckpt = _copy(tmp_path, "qwen2_sw")
    _edit_config(ckpt, layer_types=["full_attention", "chunked_attention"])
    return ckpt, r"config\.json: layer_types has kinds \['chunked_attention'\] this model cannot run"


def _bad_missing_key_in_config(tmp_path):
    ckpt = _copy(tmp_path, "qwen2")
    _edit_config(ckpt, num_hidden_layers=None)
    return ckpt, r"config\.json: key 'num_hidden_layers' is missing"


def _bad_rope(tmp_path):
    ckpt = _copy(tmp_path, "llama")
    _edit_config(ckpt, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    return ckpt, r"config\.json: rope_parameters\.rope_type='dynamic' is not supported"


@pytest.mark.parametrize("make", [
    _bad_missing_dir, _bad_architecture, _bad_truncated, _bad_shape, _bad_absent_key,
    _bad_missing_shard, _bad_sliding_window, _bad_layer_types, _bad_missing_key_in_config,
    _bad_rope,
], ids=lambda f: f.__name__[5:])  # fmt: skip
def test_bad_checkpoint_raises_before_any_device_memory(tmp_path, make):
    ckpt, match = make(tmp_path)
    before = len(jax.live_arrays())
    with pytest.raises(ValueError, match=match):
        Engine(EngineConfig(model=str(ckpt), **FAST))
    assert len(jax.live_arrays()) == before


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'tiny2'"):
        Engine(EngineConfig(model="tiny2"))


@pytest.mark.parametrize("name,layers,kv_heads,head_dim", [
    ("llama-3-8b", 32, 8, 128), ("qwen2.5-7b", 28, 4, 128), ("mistral-7b-v0.1", 32, 8, 128),
])  # fmt: skip
def test_model_spec_of_real_configs(name, layers, kv_heads, head_dim):
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS / name / "config.json", dtype="bfloat16")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (layers, kv_heads, head_dim)
    assert spec.bytes_per_token == 2 * layers * kv_heads * head_dim * 2


def test_auto_attention_falls_back_where_a_kernel_cannot_tile_the_head_dim():
    from pallas_kernels import api, validation

    def shape(head_dim):
        return validation.PagedShape(4, 1, head_dim, 8, 16, 4)

    assert api.auto_fits("gpu", shape(16), np.float32)
    assert not api.auto_fits("gpu", shape(24), np.float32)  # llama3_bf16's head_dim
    assert api.auto_fits("tpu", shape(128), np.float32)
    assert not api.auto_fits("tpu", shape(8), np.float32)  # mistral's head_dim


def _study(tmp_path, *args):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", *args, f"--config.output_dir={tmp_path}"],
                          check=False, cwd=root, capture_output=True, text=True, timeout=120)


def test_fragmentation_reports_kv_bytes_of_a_real_config(tmp_path):
    proc = _study(tmp_path, "experiments.fragmentation",
                  "--config=experiments/configs/fragmentation.py:smoke",
                  "--config.model_config=experiments/model_configs/qwen2.5-7b/config.json")
    assert proc.returncode == 0, proc.stderr
    kv = json.loads((tmp_path / "fragmentation.json").read_text())["kv_bytes"]
    assert kv["bytes_per_token"] == 57344 and "57344 B per token" in proc.stdout
    fixed = kv["layouts"][0]
    assert fixed["allocated_bytes"] == 3 * 64 * 57344  # smoke: 3 sequences reserve 64 each


def test_checkpoint_load_bench_smoke(tmp_path):
    proc = _study(tmp_path, "experiments.checkpoint_load_bench",
                  "--config=experiments/configs/checkpoint_load_bench.py:smoke")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "checkpoint_load_bench.json").read_text())
    assert set(report["summary"]) == {f"{m}_{c}" for m in ("read", "load_bfloat16", "load_float32")
                                      for c in ("cold", "warm")}
    assert report["checkpoint_bytes"] > 4 * 2**20


def test_params_given_for_a_checkpoint_still_use_its_tokenizer():
    """Studies load a checkpoint once and pass its params to each engine they build."""
    config, params = load_checkpoint(FIXTURES / "bpe")
    engine = Engine(EngineConfig(model=str(FIXTURES / "bpe"), **FAST), model_config=config,
                    params=params)
    assert isinstance(engine.tokenizer, HFTokenizer) and engine.tokenizer.eos_ids == (2, 3)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_logprobs_match_transformers_with_chunked_prefill(name):
    """Prompt logprobs (teacher-forced in transformers) within 2e-3 with prefill chunked into
    32-token pieces; generated tokens' logprobs and top-5 agree with transformers' greedy run."""
    record = expected(name)
    engine = Engine(EngineConfig(model=str(FIXTURES / name), max_model_len=256, max_num_seqs=8,
                                 max_num_batched_tokens=32, min_token_bucket=32,
                                 min_seq_bucket=8))  # one step shape per variant
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5,
                        prompt_logprobs=5)
    prompts = [p for p in record["prompts"] if len(p["ids"]) > 40][:2]  # several chunks each
    assert prompts
    outs = engine.generate([p["ids"] for p in prompts], sp)
    for out, want in zip(outs, prompts):
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(want["ids"])
        for i in range(1, len(want["ids"])):
            tok = want["ids"][i]
            assert abs(got[i][tok] - want["prompt_logprobs"][i]) < 2e-3, (i, got[i], want["prompt_logprobs"][i])
            for t, lp in want["prompt_top5"][i]:
                if t in got[i]:
                    assert abs(got[i][t] - lp) < 2e-3
        assert out.token_ids == want["greedy"][:6]
        for j, d in enumerate(out.outputs[0].logprobs):
            assert abs(d[want["greedy"][j]] - want["greedy_logprobs"][j]) < 2e-3
            assert max(d, key=d.get) == want["greedy"][j]
