"""Bundled models: ``load_model(name) -> (config, params)``; ``init_params`` for random weights;
``load_any(name_or_checkpoint)`` for the engine (bundled names, Hugging Face checkpoints, GGUF
files and packaged GGUF models such as "smollm2-135m").

Weights live in ``paged/models/weights/<name>.npz`` (float16 to stay small; loaded as float32) beside
``<name>.json`` (config, training results, the command that reproduces them, the corpus).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from paged.models.config import LlamaConfig
from paged.models.llama import Llama

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
KNOWN_MODELS = ("tiny", "tiny-draft", "tiny-sliding", "tiny-mixed")
# Sliding variants of "tiny": its trained weights (trained with full attention) served with a
# window of 32 tokens in every layer ("tiny-sliding") or in layers 1 and 3 ("tiny-mixed"). For
# tests and studies of the machinery; the text they write is not what tiny was trained for.
SLIDING_VARIANTS = {
    "tiny-sliding": {"sliding_window": 32},
    "tiny-mixed": {"sliding_window": 32, "layer_types": (
        "full_attention", "sliding_attention", "full_attention", "sliding_attention")},
}

Params = dict[str, Any]


def init_params(config: LlamaConfig, seed: int = 0) -> Params:
    """Random float32 params for ``config`` (tests, training from scratch)."""
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
    tokens = jnp.zeros((1, 1), jnp.int32)
    init = jax.jit(lambda key: Llama(config).init(key, tokens, method="dense"))
    return jax.tree.map(np.asarray, init(jax.random.key(seed)))


def num_params(params: Params) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def save_model(
    directory: str | Path,
    name: str,
    config: LlamaConfig,
    params: Params,
    meta: dict,
    *,
    store_dtype: str = "float16",
) -> tuple[Path, Path]:
    """Writes ``<name>.npz`` (params cast to ``store_dtype``) and ``<name>.json`` (config + meta).

    Returns:
      The two paths.

    Raises:
      ValueError: ``store_dtype`` not float16/float32, or a value that ``store_dtype`` cannot hold.
    """
    if store_dtype not in ("float16", "float32"):
        raise ValueError(f"store_dtype={store_dtype!r} must be 'float16' or 'float32'")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    flat = traverse_util.flatten_dict(jax.device_get(params), sep="/")
    arrays = {}
    for key, value in flat.items():
        stored = np.asarray(value, np.float32).astype(store_dtype)
        if not np.all(np.isfinite(stored)):
            raise ValueError(f"param {key} does not fit in {store_dtype}")
        arrays[key] = stored
    npz = directory / f"{name}.npz"
    np.savez(npz, **arrays)
    record = {
        "name": name,
        "config": config.to_dict(),
        "num_params": num_params(params),
        "store_dtype": store_dtype,
        "npz_sha256": hashlib.sha256(npz.read_bytes()).hexdigest(),
        **meta,
    }
    js = directory / f"{name}.json"
    js.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return npz, js


def load_from(npz: str | Path, js: str | Path) -> tuple[LlamaConfig, Params]:
    """Loads a model written by `save_model` from explicit paths; params are float32 numpy."""
    record = json.loads(Path(js).read_text())
    config = LlamaConfig.from_dict(record["config"])
    with np.load(npz) as data:
        flat = {k: np.asarray(data[k], np.float32) for k in data.files}
    params = traverse_util.unflatten_dict(flat, sep="/")
    tokens = jnp.zeros((1, 1), jnp.int32)
    expected = jax.eval_shape(lambda: Llama(config).init(jax.random.key(0), tokens, method="dense"))
    want = {k: v.shape for k, v in traverse_util.flatten_dict(expected, sep="/").items()}
    got = {k: v.shape for k, v in flat.items()}
    if want != got:
        raise ValueError(f"{npz}: param shapes {got} do not match {config}: {want}")
    return config, params


def model_info(name: str) -> dict:
    """The json record of a bundled model (config, losses, command, corpus, ``npz_sha256``). A
    sliding variant gives tiny's training record under its own ``name``, its ``config`` with the
    window (``sliding_window``, ``layer_types``) it is served with, and ``weights_of: "tiny"``."""
    _check_name(name)
    if name not in SLIDING_VARIANTS:
        return json.loads((WEIGHTS_DIR / f"{name}.json").read_text())
    record = json.loads((WEIGHTS_DIR / "tiny.json").read_text())
    window = {k: list(v) if isinstance(v, tuple) else v for k, v in SLIDING_VARIANTS[name].items()}
    return {**record, "name": name, "weights_of": "tiny",
            "config": {**record["config"], **window}}


def load_model(name: str) -> tuple[LlamaConfig, Params]:
    """Loads a bundled model.

    Args:
      name: one of ``KNOWN_MODELS`` ("tiny", "tiny-draft", and tiny's weights with sliding
        windows: "tiny-sliding", "tiny-mixed"; all use `ByteTokenizer`), or a Llama ``.gguf``
        file or packaged GGUF model ("smollm2-135m"; float32, see `paged.models.gguf`).

    Returns:
      ``(config, params)``; params are float32 numpy arrays in a nested dict ready for
      ``Llama(config).apply(params, ...)``.

    Raises:
      ValueError: unknown name.
      FileNotFoundError: the weight files are missing from the installation.
    """
    import paged.models.gguf as gguf

    if gguf.is_gguf_path(name):
        return gguf.load_gguf(name)
    _check_name(name)
    if name in SLIDING_VARIANTS:
        config, params = load_model("tiny")
        return dataclasses.replace(config, **SLIDING_VARIANTS[name]), params
    npz, js = WEIGHTS_DIR / f"{name}.npz", WEIGHTS_DIR / f"{name}.json"
    for path in (npz, js):
        if not path.exists():
            raise FileNotFoundError(
                f"{path} missing; retrain with the command in the docs of experiments/train_tiny.py"
            )
    return load_from(npz, js)


def load_any(model: str, *, dtype: str = "float32", max_model_len: int | None = None):
    """``(config, params, tokenizer)`` of a bundled model name or a Hugging Face checkpoint dir.

    Args:
      model: one of ``KNOWN_MODELS`` (float32 params, `ByteTokenizer`); a packaged model
        (``paged.models.gguf.PACKAGED``, e.g. "smollm2-135m") or a Llama ``.gguf`` file
        (`paged.models.gguf.load_gguf`, layers stacked by `paged.models.scan_layers`; tokenizer
        `paged.models.gguf_tokenizer.GGUFTokenizer`);
        or a directory with
        ``config.json`` and safetensors weights (`paged.models.hf.load_checkpoint`; tokenizer from
        `paged.models.hf_tokenizer.load_tokenizer`).
      dtype: params and compute dtype of a checkpoint (bundled models stay float32).
      max_model_len: the longest sequence the caller will serve (checked against a checkpoint's
        sliding window).

    Raises:
      ValueError: an unknown name, or a checkpoint that cannot be loaded exactly (the message
        names the file and the key).
    """
    import paged.models.gguf as gguf
    import paged.models.hf as hf
    from paged.models.hf_tokenizer import load_tokenizer
    from paged.models.scan_layers import stack_layers
    from paged.models.tokenizer import ByteTokenizer

    if model in KNOWN_MODELS:
        return (*load_model(model), ByteTokenizer())
    if gguf.is_gguf_path(model):
        from paged.models.gguf_tokenizer import GGUFTokenizer

        reader = gguf.open_gguf(gguf.resolve(model))
        config, params = gguf.load_gguf(model, dtype=dtype, reader=reader)
        # stacked layers: one scanned block, so a deep model compiles in seconds
        return config, stack_layers(config, params), GGUFTokenizer(model, reader=reader)
    if hf.is_checkpoint_dir(model) or "/" in model or Path(model).exists():
        config, params = hf.load_checkpoint(model, dtype=dtype, max_model_len=max_model_len)
        return config, params, load_tokenizer(model, config.vocab_size)
    raise ValueError(f"unknown model {model!r}: a bundled model {list(KNOWN_MODELS)}, a packaged "
                     f"one {sorted(gguf.PACKAGED)}, a .gguf file or a checkpoint directory "
                     "(config.json + safetensors)")


def _check_name(name: str) -> None:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {list(KNOWN_MODELS)}")
