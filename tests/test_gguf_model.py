"""SmolLM2-135M from its GGUF file: the real weights against a float64 numpy reference, and the
paged engine against the same model run densely without a cache and against the contiguous
engine. One model load and one engine step shape per engine for the module."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged import Engine, EngineConfig, SamplingParams
from paged.models.gguf import load_gguf, packaged_path, unpermute_rows
from paged.models.llama import Llama
from paged.models.scan_layers import is_stacked, stack_layers

MODEL = "smollm2-135m"
try:
    packaged_path(MODEL)
except ValueError as e:  # pragma: no cover -- `make install` installs it
    pytest.skip(str(e), allow_module_level=True)

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32,
              min_seq_bucket=4)  # one step shape per variant; prompts prefill in chunks
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The history of the Roman Empire spans more than a thousand years, from",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model():
    config, params = load_gguf(MODEL)
    return config, params


@pytest.fixture(scope="module")
def stacked(model):
    config, params = model
    return config, stack_layers(config, params)


@pytest.fixture(scope="module")
def dense(stacked):
    """Next-token logits of the whole model without a cache (inputs padded to 64 tokens: one
    compile; causal, so padding after a sequence changes nothing before it)."""
    config, params = stacked
    fn = jax.jit(lambda p, t: Llama(config).apply(p, t, method="dense"))

    def run(ids):
        padded = np.zeros((1, 64), np.int32)
        padded[0, :len(ids)] = ids
        return np.asarray(fn(params, jnp.asarray(padded))[0, :len(ids)], np.float64)

    return run


def test_config_from_metadata(model):
    config, params = model
    assert (config.num_layers, config.d_model, config.num_heads, config.num_kv_heads,
            config.head_dim, config.ffn_dim, config.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert config.rope_theta == 100000.0 and config.max_seq_len == 8192
    assert config.norm_eps == pytest.approx(1e-5) and config.tie_embeddings  # no output.weight
    assert "lm_head" not in params["params"]


def test_unpermute_inverts_convert_hf_to_gguf():
    """``permute`` as llama.cpp's convert_hf_to_gguf.py writes it, then ours undoes it."""
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
            .reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 8, 5))
    assert np.array_equal(unpermute_rows(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, theta):  # [T, N, H], rotate-half, float64
    t, _, h = x.shape
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    ang = np.arange(t)[:, None] * inv
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :h // 2], x[..., h // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _reference(config, params, ids, num_layers):
    """float64 numpy forward of the first ``num_layers`` blocks, then the final norm and head."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    x = p["embedding"][ids]
    t, g = len(ids), config.num_heads // config.num_kv_heads
    mask = np.tril(np.ones((t, t), bool))
    for i in range(num_layers):
        blk = p[f"layers_{i}"]
        h = _rms(x, blk["attn_norm"]["scale"], config.norm_eps)
        q = _rope(np.einsum("TD,DNH->TNH", h, blk["attn"]["q_proj"]), config.rope_theta)
        k = _rope(np.einsum("TD,DKH->TKH", h, blk["attn"]["k_proj"]), config.rope_theta)
        v = np.einsum("TD,DKH->TKH", h, blk["attn"]["v_proj"])
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.einsum("TNH,SNH->NTS", q, k) / np.sqrt(config.head_dim)
        s = np.where(mask, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        x = x + np.einsum("NTS,SNH,NHD->TD", w, v, blk["attn"]["o_proj"])
        h = _rms(x, blk["mlp_norm"]["scale"], config.norm_eps)
        gate, up = h @ blk["mlp"]["gate"], h @ blk["mlp"]["up"]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ blk["mlp"]["down"]
    return _rms(x, p["final_norm"]["scale"], config.norm_eps) @ p["embedding"].T


def test_first_layers_match_float64_numpy(model):
    """Two blocks of the real (dequantized, unpermuted) weights: Flax float32 vs numpy float64."""
    config, params = model
    short = dataclasses.replace(config, num_layers=2)
    inner = {k: v for k, v in params["params"].items()
             if not k.startswith("layers_") or k in ("layers_0", "layers_1")}
    ids = np.array([504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378, 3575])
    got = np.asarray(Llama(short).apply({"params": inner}, jnp.asarray(ids[None]),
                                        method="dense")[0], np.float64)
    want = _reference(config, {"params": inner}, ids, 2)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-4)


def test_real_weights_model_english(dense, stacked):
    """Sanity of the whole mapping: the model predicts ordinary English well (a wrong RoPE
    layout or head order raises this loss by more than a nat)."""
    from paged.models.gguf_tokenizer import GGUFTokenizer

    tok = GGUFTokenizer(MODEL)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. The capital of France is "
                     "Paris, and the capital of Germany is Berlin.")
    logp = _log_softmax(dense(ids))
    nll = -np.mean(logp[np.arange(len(ids) - 1), ids[1:]])
    assert nll < 3.5, nll


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# Greedy, prompt log-probabilities, and the chat prompt's answer ends at <|im_end|> (EOS on).
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, seed=0, prompt_logprobs=1)


@pytest.fixture(scope="module")
def paged_run(stacked):
    """One paged engine's greedy outputs on the three prompts and one conversation (last), read by
    the two tests below (one 30-layer engine run instead of two)."""
    config, params = stacked
    assert is_stacked(params)
    engine = Engine(EngineConfig(model=MODEL, **ENGINE), model_config=config, params=params)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    return prompts, engine.generate([*prompts, CHAT], GREEDY)


def test_paged_engine_equals_dense_model(paged_run, dense):
    """Greedy tokens and prompt log-probabilities through the paged engine (prefill chunked into
    32-token pieces) equal the dense no-cache forward of the same params."""
    prompts, outs = paged_run
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        full = prompt + gen
        assert len(full) <= 64  # the dense forward's padded width
        logp = _log_softmax(dense(full))
        for i in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[i][prompt[i]] - logp[i - 1, prompt[i]]) < 2e-3
        for j, tok in enumerate(gen):
            row = logp[len(prompt) + j - 1]
            top2 = np.sort(row)[-2:]
            if top2[1] - top2[0] > 1e-3:  # not a near-tie: the argmax is determined
                assert tok == int(np.argmax(row)), (j, tok, int(np.argmax(row)))


def test_paged_equals_contiguous_engine_and_chat_answers(stacked, paged_run):
    config, params = stacked
    prompts, paged = paged_run
    engine = Engine(EngineConfig(model=MODEL, kv_layout="contiguous", **ENGINE),
                    model_config=config, params=params)
    contiguous = engine.generate([*PROMPTS, CHAT],
                                 dataclasses.replace(GREEDY, prompt_logprobs=None))
    assert [o.prompt_token_ids for o in contiguous[:-1]] == prompts
    assert [o.token_ids for o in paged] == [o.token_ids for o in contiguous]
    answer = paged[0]
    assert "Paris" in answer.text and answer.outputs[0].token_ids[-1] == 2  # <|im_end|> stops
    # A conversation is rendered with the file's template (default system prompt included).
    chat = paged[-1]
    assert chat.prompt_token_ids == engine.tokenizer.encode(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert "Paris" in chat.text
