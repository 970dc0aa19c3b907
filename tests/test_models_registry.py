"""Bundled weights: load_model and a loose check that "tiny" learned stdlib-like text."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.models import KNOWN_MODELS, ByteTokenizer, Llama, load_model, model_info
from paged.models.registry import num_params


def test_unknown_name_lists_known_models():
    with pytest.raises(ValueError, match="tiny-draft"):
        load_model("huge")


@pytest.mark.parametrize("name", KNOWN_MODELS)
def test_bundled_model_loads_as_float32(name):
    config, params = load_model(name)
    assert config.vocab_size == ByteTokenizer.vocab_size
    assert config.head_dim == 64
    leaves = jax.tree.leaves(params)
    assert all(x.dtype == np.float32 and np.isfinite(x).all() for x in leaves)
    assert num_params(params) == model_info(name)["num_params"]
    info = model_info(name)
    for key in ("final_train_loss", "final_eval_loss", "command", "jax_version", "corpus"):
        assert key in info, key
    # The record's config is the one served: a sliding variant's window and layer types too.
    assert info["name"] == name
    for key in ("sliding_window", "layer_types"):
        want = getattr(config, key)
        assert info["config"].get(key) == (list(want) if isinstance(want, tuple) else want), key


def test_tiny_greedy_continuation_is_text():
    config, params = load_model("tiny")
    tok = ByteTokenizer()
    prompt = tok.encode("def ")
    length = 48  # fixed buffer: causal, so the padding after the prompt never changes its logits
    forward = jax.jit(lambda p, t: Llama(config).apply(p, t[None], method="dense")[0])
    buf = np.zeros(length, np.int32)
    buf[: len(prompt)] = prompt
    for n in range(len(prompt), length):
        buf[n] = int(jnp.argmax(forward(params, buf)[n - 1]))
    text = tok.decode(buf[len(prompt) :])
    printable = sum(c.isprintable() or c in "\n\t" for c in text)
    assert len(text) >= 30 and printable >= 0.9 * len(text), repr(text)
    assert len(set(text)) >= 5, repr(text)  # not one character repeated


def test_a_window_not_shorter_than_max_model_len_warns_once():
    from paged.config.engine_config import EngineConfig
    from paged.engine.engine import Engine

    config = EngineConfig(model="tiny-mixed", max_model_len=24, max_num_seqs=2)
    with pytest.warns(UserWarning, match=r"sliding_window=32 .* max_model_len=24"):
        Engine(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(config)  # once per pair of numbers
        Engine(EngineConfig(model="tiny-mixed", max_model_len=64, max_num_seqs=2))
