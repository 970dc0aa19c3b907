"""Builds the tiny Hugging Face checkpoints under ``tests/fixtures/hf/`` with transformers.

Needs torch, transformers, safetensors and tokenizers, which the package does not depend on:
run it from a throwaway environment, for example::

    python3 -m venv /tmp/hfenv
    /tmp/hfenv/bin/pip install torch transformers safetensors tokenizers numpy
    /tmp/hfenv/bin/python experiments/make_hf_fixtures.py            # all fixtures
    /tmp/hfenv/bin/python experiments/make_hf_fixtures.py qwen2 bpe  # some of them

This script imports neither ``paged`` nor JAX. Each fixture is a directory written by
``save_pretrained`` (``config.json``, ``generation_config.json``, ``model.safetensors`` or two
shards with ``model.safetensors.index.json``; the ``bpe`` fixture also has a byte-level BPE
``tokenizer.json`` trained here with the ``tokenizers`` library and a ``tokenizer_config.json``),
plus ``expected.json``: what transformers computes on the fixture's prompts in float32 from the
weights as stored (rounded to the storage dtype, then upcast):

* ``greedy``: 24 new tokens (64 for the sliding-window fixtures ``mistral_sw`` and ``qwen2_sw``)
  of a no-cache argmax loop (``model(ids).logits[:, -1].argmax()``,
  the whole sequence recomputed every step, no KV cache), with each step's logprob, top-5 and the
  gap between the two best logits (``min_margin``: the smallest gap, to see that float rounding
  cannot flip an argmax);
* ``prompt_logprobs``: teacher-forced ``log_softmax`` over the prompt; entry ``t`` is the logprob
  of ``ids[t]`` given ``ids[:t]`` (``None`` for ``t = 0``), ``prompt_top5[t]`` the five best
  ``[id, logprob]`` of that distribution.

Weights are drawn wider than transformers' default initializer (std 0.02 gives near-uniform
logits, where any rounding difference flips an argmax); norm weights and biases are random too,
so a mapping mistake in a loader changes the outputs.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
NEW_TOKENS = 24
PROMPT_LENS = (1, 2, 5, 16, 33, 64, 100, 130)
COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5}

# A small multilingual text for the BPE tokenizer: English, code, accents, CJK and emoji, so the
# learned merges include multi-byte characters and the byte-level fallback is exercised.
CORPUS = """\
The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in blocks.
def main():\n    print("hello, world")\n    return 0\n
Café, naïve, façade, jalapeño: accents survive a round trip through bytes.
東京は日本の首都です。猫が好きです。今日はいい天気ですね。
北京欢迎你。我们一起学习。你好，世界！
서울은 한국의 수도입니다. 안녕하세요.
Emoji: 🙂 😀 🚀 🎉 👍🏽 ❤️ 🇯🇵 — they take four bytes, some take several code points.
Numbers 0123456789, symbols %&*()[]{}<>, and a long line of text to learn a few merges.
The cache stores keys and values; the scheduler admits, preempts and resumes requests.
""" * 3

SPECIALS = ["<unk>", "<s>", "</s>", "<|eot|>"]


def _fixtures() -> dict[str, dict]:
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return {
        "llama": {"cls": "Llama", "dtype": "float32", "seed": 1, "cfg": {
            "vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "tie_word_embeddings": False}},
        "llama3_bf16": {"cls": "Llama", "dtype": "bfloat16", "seed": 2, "cfg": {
            "vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 24,
            "tie_word_embeddings": False, "rope_parameters": llama3}},
        "llama_sharded": {"cls": "Llama", "dtype": "float16", "seed": 3, "shards": 2, "cfg": {
            "vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}},
        "qwen2": {"cls": "Qwen2", "dtype": "float32", "seed": 4, "cfg": {
            "vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}},
        "mistral": {"cls": "Mistral", "dtype": "float32", "seed": 5, "cfg": {
            "vocab_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
            "sliding_window": 4096, "tie_word_embeddings": False}},
        # Sliding windows shorter than the prompts (up to 130 tokens) and 64 new tokens: every
        # layer of "mistral_sw" slides; "qwen2_sw" has a full layer 0 and a sliding layer 1
        # (sliding above max_window_layers, as transformers reads Qwen2's config).
        "mistral_sw": {"cls": "Mistral", "dtype": "float32", "seed": 7, "new_tokens": 64, "cfg": {
            "vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "sliding_window": 16, "tie_word_embeddings": True}},
        "qwen2_sw": {"cls": "Qwen2", "dtype": "float32", "seed": 8, "new_tokens": 64, "cfg": {
            "vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 16,
            "max_window_layers": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}},
        "bpe": {"cls": "Llama", "dtype": "float32", "seed": 6, "tokenizer": True, "cfg": {
            "vocab_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}},
    }


def _randomize(model: torch.nn.Module, seed: int, dtype: torch.dtype) -> None:
    """Wide random weights, rounded to the storage dtype (kept float32 for the reference run)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                new = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
            elif name.endswith("bias"):
                new = 0.5 * torch.randn(p.shape, generator=g)
            elif "embed_tokens" in name:
                new = torch.randn(p.shape, generator=g)
            else:  # Linear [out, in]; lm_head gets logits of std ~3
                scale = 3.0 if "lm_head" in name else 1.5
                new = scale / math.sqrt(p.shape[1]) * torch.randn(p.shape, generator=g)
            p.copy_(new.to(dtype).to(torch.float32))


def _train_tokenizer(vocab_size: int):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def _text_prompts(hf_tok) -> list[dict]:
    """Texts whose encodings span 2..130 tokens, multi-byte characters included."""
    texts = ["a", "Café 🙂", "東京は日本の首都です。🚀 and 北京", "def main():\n    print(\"hi\")"]
    for target in (64, 100, 130):
        text = ""
        for ch in CORPUS:
            if len(hf_tok(text + ch).input_ids) > target:
                break
            text += ch
        texts.append(text)
    return [{"text": t, "ids": hf_tok(t).input_ids} for t in texts]


def _f(x: float) -> float:
    return float(f"{x:.7g}")  # float32 precision is all the values carry


def _greedy(model, ids: list[int], new_tokens: int = NEW_TOKENS) -> dict:
    ids = list(ids)
    out, lps, top5, margins = [], [], [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[:, -1].float()[0]
            nxt = int(logits.argmax())
            logp = torch.log_softmax(logits, -1)
            two = torch.topk(logits, 2).values
            margins.append(float(two[0] - two[1]))
            tv, ti = torch.topk(logp, 5)
            out.append(nxt)
            lps.append(_f(logp[nxt]))
            top5.append([[int(i), _f(v)] for i, v in zip(ti, tv)])
            ids.append(nxt)
    return {"greedy": out, "greedy_logprobs": lps, "greedy_top5": top5,
            "min_margin": min(margins)}


def _prompt_logprobs(model, ids: list[int]) -> dict:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    lps, top5 = [None], [None]
    for t in range(1, len(ids)):
        tv, ti = torch.topk(logp[t - 1], 5)
        lps.append(_f(logp[t - 1, ids[t]]))
        top5.append([[int(i), _f(v)] for i, v in zip(ti, tv)])
    return {"prompt_logprobs": lps, "prompt_top5": top5}


def build(name: str, spec: dict) -> Path:
    out = ROOT / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.manual_seed(spec["seed"])
    cfg_cls = getattr(transformers, f"{spec['cls']}Config")
    model_cls = getattr(transformers, f"{spec['cls']}ForCausalLM")
    config = cfg_cls(**COMMON, **spec["cfg"])
    model = model_cls(config).float().eval()
    dtype = getattr(torch, spec["dtype"])
    _randomize(model, spec["seed"], dtype)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    hf_tok = None
    if spec.get("tokenizer"):
        from transformers import PreTrainedTokenizerFast

        _train_tokenizer(config.vocab_size).save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True,
            "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "model_max_length": 256}, indent=2) + "\n")
        hf_tok = PreTrainedTokenizerFast.from_pretrained(out)
        # Two stop tokens, so the list form of generation_config's eos_token_id is tested.
        model.generation_config.eos_token_id = [config.eos_token_id,
                                                hf_tok.convert_tokens_to_ids("<|eot|>")]

    rng = np.random.default_rng(spec["seed"])
    prompts = [{"ids": rng.integers(0, config.vocab_size, n).tolist()} for n in PROMPT_LENS]
    if hf_tok is not None:
        prompts = [{"ids": [config.bos_token_id]}] + _text_prompts(hf_tok) + prompts[-1:]
    for p in prompts:
        p.update(_greedy(model, p["ids"], spec.get("new_tokens", NEW_TOKENS)))
        p.update(_prompt_logprobs(model, p["ids"]))
        if hf_tok is not None:
            p["greedy_text"] = hf_tok.decode(p["greedy"], skip_special_tokens=True)

    model = model.to(dtype)
    kw = {}
    if spec.get("shards"):
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        if config.tie_word_embeddings:
            total -= model.lm_head.weight.numel() * model.lm_head.weight.element_size()
        kw["max_shard_size"] = int(total * 0.6)  # packed greedily: two files, not three
    model.save_pretrained(out, **kw)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == spec.get("shards", 1), files
    record = {
        "fixture": name,
        "architecture": model_cls.__name__,
        "storage_dtype": spec["dtype"],
        "seed": spec["seed"],
        "new_tokens": spec.get("new_tokens", NEW_TOKENS),
        "method": "float32 transformers, no-cache argmax loop; teacher-forced log_softmax",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "command": f"python experiments/make_hf_fixtures.py {name}",
        "min_margin": min(p["min_margin"] for p in prompts),
        "prompts": prompts,
    }
    (out / "expected.json").write_text(json.dumps(record) + "\n")
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, files {sorted(p.name for p in out.iterdir())}, "
          f"min greedy margin {record['min_margin']:.3g}")
    return out


def main(argv: list[str]) -> None:
    fixtures = _fixtures()
    names = argv or list(fixtures)
    unknown = sorted(set(names) - set(fixtures))
    if unknown:
        raise SystemExit(f"unknown fixtures {unknown}; known: {list(fixtures)}")
    for name in names:
        build(name, fixtures[name])


if __name__ == "__main__":
    main(sys.argv[1:])
