"""Hugging Face safetensors checkpoints loaded into the Flax `Llama`'s params.

``load_checkpoint(directory, dtype="float32") -> (LlamaConfig, params)`` reads a directory written by
transformers' ``save_pretrained``: ``config.json`` (see `paged.models.hf_config` for what is
accepted) and either ``model.safetensors`` or shards ``model-0000i-of-0000n.safetensors`` listed in
``model.safetensors.index.json``. Tensors are read with the ``safetensors`` library's numpy backend
(``safe_open`` memory-maps each file; each file is opened once and each tensor read once) and
converted on the host:

=====================================================  ===============================================
Hugging Face tensor (PyTorch ``Linear`` is [out, in])   param of `Llama` (``params/...``)
=====================================================  ===============================================
``model.embed_tokens.weight`` [V, D]                    ``embedding`` [V, D]
``model.layers.{i}.input_layernorm.weight`` [D]         ``layers_{i}/attn_norm/scale``
``model.layers.{i}.self_attn.q_proj.weight`` [N*H, D]   ``layers_{i}/attn/q_proj`` [D, N, H]
``... k_proj.weight`` / ``v_proj.weight`` [K*H, D]      ``.../k_proj`` / ``.../v_proj`` [D, K, H]
``... q_proj.bias`` / ``k_proj.bias`` / ``v_proj.bias``  ``.../q_bias`` [N, H], ``k_bias`` / ``v_bias`` [K, H]
``model.layers.{i}.self_attn.o_proj.weight`` [D, N*H]   ``layers_{i}/attn/o_proj`` [N, H, D]
``model.layers.{i}.post_attention_layernorm.weight``    ``layers_{i}/mlp_norm/scale``
``model.layers.{i}.mlp.gate_proj`` / ``up_proj`` [F, D]  ``layers_{i}/mlp/gate`` / ``up`` [D, F]
``model.layers.{i}.mlp.down_proj.weight`` [D, F]        ``layers_{i}/mlp/down`` [F, D]
``model.norm.weight`` [D]                               ``final_norm/scale``
``lm_head.weight`` [V, D] (untied only)                 ``lm_head`` [D, V]
=====================================================  ===============================================

Both use the "rotate-half" RoPE layout (dimension ``i`` pairs with ``i + H/2``), so q/k need no
permutation. Weights stored as float32, float16 or bfloat16 become the requested dtype. Every
check (files, keys, shapes, dtypes) runs on the files' headers before any tensor is read, and the
result is numpy: nothing is put on a device here.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from paged.models.config import LlamaConfig
from paged.models.hf_config import HFModel, read_hf_config, read_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
STORED_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}
# Keys some checkpoints carry that hold nothing the model needs (RoPE tables are recomputed).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

Params = dict[str, Any]


def is_checkpoint_dir(path: Any) -> bool:
    """True if ``path`` names a directory with a ``config.json`` (a model name is not one)."""
    try:
        return isinstance(path, (str, Path)) and (Path(path) / "config.json").is_file()
    except OSError:
        return False


_TILE = 128


def transpose(w: np.ndarray, dtype) -> np.ndarray:
    """``w.T`` as a new C-contiguous array of ``dtype``, copied tile by tile.

    A plain ``np.ascontiguousarray(w.T)`` walks one of the two arrays with a stride of a whole
    row and runs about 3x slower on large matrices (measured with
    ``experiments/checkpoint_load_bench.py``); 128 x 128 tiles keep both sides in cache.
    """
    rows, cols = w.shape
    out = np.empty((cols, rows), dtype)
    for i in range(0, rows, _TILE):
        for j in range(0, cols, _TILE):
            out[j:j + _TILE, i:i + _TILE] = w[i:i + _TILE, j:j + _TILE].T
    return out


def weight_map(model: HFModel) -> dict[str, tuple[tuple[int, ...], str, Any]]:
    """Every tensor the checkpoint must hold: HF name -> (HF shape, param path, convert).

    ``convert(array, dtype)`` turns the stored array (HF layout) into the param's layout and dtype.
    """
    c = model.config
    d, n, k, h, f, v = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size
    same = lambda w, dt: np.asarray(w, dt)
    t = transpose

    def heads(count):  # [count*h, d] -> [d, count, h]
        return lambda w, dt: t(w, dt).reshape(d, count, h)

    def bias(count):
        return lambda b, dt: np.asarray(b, dt).reshape(count, h)

    out = {
        "model.embed_tokens.weight": ((v, d), "embedding", same),
        "model.norm.weight": ((d,), "final_norm/scale", same),
    }
    if not c.tie_embeddings:
        out["lm_head.weight"] = ((v, d), "lm_head", t)
    for i in range(c.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers_{i}/"
        out.update({
            hf + "input_layernorm.weight": ((d,), ours + "attn_norm/scale", same),
            hf + "post_attention_layernorm.weight": ((d,), ours + "mlp_norm/scale", same),
            hf + "self_attn.q_proj.weight": ((n * h, d), ours + "attn/q_proj", heads(n)),
            hf + "self_attn.k_proj.weight": ((k * h, d), ours + "attn/k_proj", heads(k)),
            hf + "self_attn.v_proj.weight": ((k * h, d), ours + "attn/v_proj", heads(k)),
            hf + "self_attn.o_proj.weight": ((d, n * h), ours + "attn/o_proj",
                                             lambda w, dt: t(w, dt).reshape(n, h, d)),
            hf + "mlp.gate_proj.weight": ((f, d), ours + "mlp/gate", t),
            hf + "mlp.up_proj.weight": ((f, d), ours + "mlp/up", t),
            hf + "mlp.down_proj.weight": ((d, f), ours + "mlp/down", t),
        })  # fmt: skip
        if c.qkv_bias:
            out.update({
                hf + "self_attn.q_proj.bias": ((n * h,), ours + "attn/q_bias", bias(n)),
                hf + "self_attn.k_proj.bias": ((k * h,), ours + "attn/k_bias", bias(k)),
                hf + "self_attn.v_proj.bias": ((k * h,), ours + "attn/v_bias", bias(k)),
            })  # fmt: skip
    return out


def shard_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint and, when sharded, the index's key -> file name map.

    Raises:
      ValueError: neither ``model.safetensors`` nor ``model.safetensors.index.json``, a malformed
        index, or a shard it names that does not exist.
    """
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path)
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict) or not all(
                isinstance(a, str) and isinstance(b, str) for a, b in wmap.items()):
            raise ValueError(f"{index_path}: key 'weight_map' must map tensor names to file names")
        files = []
        for name in sorted(set(wmap.values())):
            path = directory / name
            if Path(name).name != name or not path.is_file():
                raise ValueError(f"{index_path}: shard {name!r} (in weight_map) not found in "
                                 f"{directory}")
            files.append(path)
        return files, wmap
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise ValueError(f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}")
    return [single], None


def _open(path: Path, stack: contextlib.ExitStack):
    from safetensors import safe_open

    try:
        return stack.enter_context(safe_open(str(path), framework="numpy"))
    except Exception as e:  # noqa: BLE001 -- the library raises its own error types
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def load_checkpoint(directory: str | Path, *, dtype: str = "float32",
                    max_model_len: int | None = None) -> tuple[LlamaConfig, Params]:
    """Loads a Hugging Face checkpoint directory as ``(LlamaConfig, params)``.

    Args:
      directory: a directory with ``config.json`` and safetensors weights (single file or
        sharded with an index).
      dtype: dtype of the returned params and of ``LlamaConfig.dtype`` ("float32", "bfloat16",
        "float16"), whatever the stored dtype (float32, float16 or bfloat16).
      max_model_len: the longest sequence that will be served (checked against a sliding
        window; see `paged.models.hf_config.read_hf_config`).

    Returns:
      ``(config, params)``: params are numpy arrays in the nested dict that
      ``Llama(config).apply(params, ...)`` takes.

    Raises:
      ValueError: anything `read_hf_config` refuses; missing or unreadable (truncated)
        safetensors files; a tensor that is absent, has the wrong shape or an unsupported dtype;
        a tensor the model does not use. Each message names the file and the key.
    """
    model = read_hf_config(directory, dtype=dtype, max_model_len=max_model_len)
    directory = model.directory
    files, index = shard_files(directory)
    wanted = weight_map(model)
    target = jnp.dtype(dtype)
    with contextlib.ExitStack() as stack:
        handles = {path: _open(path, stack) for path in files}
        where = _check_headers(model, handles, index, wanted)
        flat = {}
        for path, handle in handles.items():  # each file once, each tensor once
            for key in where[path]:
                _, param, convert = wanted[key]
                flat["params/" + param] = convert(handle.get_tensor(key), target)
    params = traverse_util.unflatten_dict(flat, sep="/")
    _check_tree(model, params)
    return model.config, params


def _check_headers(model: HFModel, handles: dict, index: dict[str, str] | None,
                   wanted: dict) -> dict[Path, list[str]]:
    """Checks every file's keys, shapes and dtypes; returns the keys to read from each file."""
    found: dict[str, Path] = {}
    for path, handle in handles.items():
        for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
            if key in found:
                raise ValueError(f"{path}: key {key!r} is also in {found[key]}")
            found[key] = path
    if index is not None:
        for key, name in index.items():
            path = model.directory / name
            if found.get(key) != path:
                raise ValueError(f"{path}: key {key!r} is missing (the index lists it there)")
    tied_extra = {"lm_head.weight"} if model.config.tie_embeddings else set()
    for key, path in found.items():
        if key not in wanted and key not in tied_extra and not key.endswith(IGNORED_SUFFIXES):
            raise ValueError(f"{path}: key {key!r} is not a tensor of {model.architecture} with "
                             f"this config.json (unsupported weights would be ignored)")
    where: dict[Path, list[str]] = {path: [] for path in handles}
    files = ", ".join(str(p) for p in handles)
    for key, (shape, _, _) in wanted.items():
        path = found.get(key)
        if path is None:
            raise ValueError(f"{files}: key {key!r} is missing")
        info = handles[path].get_slice(key)
        stored, got = info.get_dtype(), tuple(info.get_shape())
        if stored not in STORED_DTYPES:
            raise ValueError(f"{path}: key {key!r} has dtype {stored}; supported: "
                             f"{sorted(STORED_DTYPES)}")
        if got != shape:
            raise ValueError(f"{path}: key {key!r} has shape {list(got)}, but "
                             f"{model.directory / 'config.json'} implies {list(shape)}")
        where[path].append(key)
    return where


def _check_tree(model: HFModel, params: Params) -> None:
    """The converted params must be exactly the tree `Llama` builds (guards the mapping itself)."""
    from paged.models.llama import Llama

    tokens = jnp.zeros((1, 1), jnp.int32)
    expected = jax.eval_shape(
        lambda: Llama(model.config).init(jax.random.key(0), tokens, method="dense"))
    want = {k: v.shape for k, v in traverse_util.flatten_dict(expected, sep="/").items()}
    got = {k: v.shape for k, v in traverse_util.flatten_dict(params, sep="/").items()}
    if want != got:
        raise ValueError(f"{model.directory}: converted params {got} do not match the model's "
                         f"{want}")
