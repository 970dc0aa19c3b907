"""A Hugging Face ``config.json`` read into a `LlamaConfig`, every unsupported setting refused.

Every problem of a file, a wrong type included, is a ValueError naming the file and the key: the
caller passed a path, and what is wrong is in the file.

``read_hf_config(directory, dtype=..., max_model_len=...) -> HFModel`` checks the architecture
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``), the shapes, RoPE
(``rope_parameters`` or the older ``rope_scaling`` + ``rope_theta``: types "default", "linear",
"llama3"), biases and sliding windows, and raises ValueError naming the file and the key for
anything this model cannot reproduce exactly.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from paged.models.config import FULL, LAYER_TYPES, SLIDING, LlamaConfig

# architecture -> model_type (the key of config.json that names it when "architectures" is absent)
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
ENGINE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class HFModel:
    """What a checkpoint's ``config.json`` says, in this project's terms.

    Attributes:
      directory: the checkpoint directory.
      architecture: e.g. "LlamaForCausalLM".
      config: the `LlamaConfig` (``dtype`` is the requested compute dtype).
      sliding_window: the window of the sliding layers (Mistral: every layer; Qwen2: the layers
        at or above ``max_window_layers``, or as ``layer_types`` says), or None when no layer
        slides; ``config.layer_types`` names each layer's kind.
      raw: the parsed ``config.json``.
    """

    directory: Path
    architecture: str
    config: LlamaConfig
    sliding_window: int | None
    raw: dict


def read_json(path: Path) -> dict:
    """Parses a JSON object file; ValueError naming the file if it is missing or malformed."""
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(data).__name__}")  # noqa: TRY004 (a bad file)
    return data


def _get(cfg: dict, path: Path, key: str, kind: type, default: Any = ...) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ValueError(f"{path}: key {key!r} is missing")
        return default
    value = cfg[key]
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{path}: {key}={value!r} must be a {kind.__name__}")
    return value


def _rope(cfg: dict, path: Path) -> dict:
    """LlamaConfig's RoPE fields from ``rope_parameters`` (transformers >= 5) or ``rope_scaling``."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise ValueError(f"{path}: {key}={params!r} must be an object")  # noqa: TRY004 (a bad file)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"{path}: rope_theta={theta!r} must be a number")  # noqa: TRY004 (a bad file)
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor={partial!r} is not supported (only 1.0)")
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3"):
        raise ValueError(
            f"{path}: {key}.rope_type={kind!r} is not supported; supported: 'default', 'linear', "
            "'llama3' ('dynamic' rescales by the length of the longest sequence in the batch, which "
            "a paged engine serving mixed lengths cannot reproduce)"
        )
    need = ("factor",) if kind == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for name in need:
        if name not in params:
            raise ValueError(f"{path}: {key}.{name} is missing (rope_type={kind!r})")
    out.update(rope_scaling=kind, rope_factor=float(params["factor"]))
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_max_len=int(params["original_max_position_embeddings"]),
        )
    return out


def _layer_kinds(cfg: dict, path: Path, model_type: str, num_layers: int
                 ) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` as transformers reads the config: Llama has no window;
    Mistral slides every layer when ``sliding_window`` is set (``layer_types`` is ignored, as its
    modeling code ignores it); Qwen2 slides only with ``use_sliding_window``, the layers at or
    above ``max_window_layers`` unless a ``layer_types`` list names each layer's kind."""
    window = cfg.get("sliding_window")
    if model_type == "llama" or window is None:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{path}: sliding_window={window!r} must be a positive int or null")
    if model_type == "mistral":
        return window, None
    if not _get(cfg, path, "use_sliding_window", bool, False):
        return None, None
    types = cfg.get("layer_types")
    if types is None:
        first = _get(cfg, path, "max_window_layers", int, num_layers)
        types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"{path}: layer_types={types!r} must be a list of {num_layers} kinds")
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"{path}: layer_types has kinds {bad} this model cannot run; supported: "
                         f"{list(LAYER_TYPES)}")
    if SLIDING not in types:
        return None, None
    return window, tuple(types)


def read_hf_config(directory: str | Path, *, dtype: str = "float32",
                   max_model_len: int | None = None) -> HFModel:
    """Reads and checks ``<directory>/config.json``.

    Args:
      directory: a checkpoint directory, or a ``config.json`` file itself.
      dtype: the engine's compute dtype ("float32", "bfloat16", "float16").
      max_model_len: the longest sequence the engine will serve (unused: kept for callers;
        sliding windows of any length are served).

    Returns:
      The `HFModel`.

    Raises:
      ValueError: no such directory or file, malformed JSON, an unknown architecture, a missing
        or mistyped key, an activation other than SiLU, biases other than Qwen2's q/k/v, an
        unsupported RoPE type, or ``layer_types`` with a kind this model cannot run. The message
        names the file and the key.
    """
    directory = Path(directory)
    if directory.is_file():  # a config.json by itself (accounting needs no weights)
        directory, path = directory.parent, directory
    elif directory.is_dir():
        path = directory / "config.json"
    else:
        raise ValueError(f"{directory}: no such checkpoint directory or config.json file")
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {ENGINE_DTYPES}")
    cfg = read_json(path)
    archs = cfg.get("architectures")
    if archs is None:
        by_type = {v: k for k, v in ARCHITECTURES.items()}
        archs = [by_type.get(cfg.get("model_type"), f"model_type={cfg.get('model_type')!r}")]
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"{path}: architectures={archs!r} is not supported; supported: "
                         f"{sorted(ARCHITECTURES)}")
    arch = archs[0]
    model_type = ARCHITECTURES[arch]
    hidden = _get(cfg, path, "hidden_size", int)
    heads = _get(cfg, path, "num_attention_heads", int)
    layers = _get(cfg, path, "num_hidden_layers", int)
    kv_heads = _get(cfg, path, "num_key_value_heads", int, heads)
    head_dim = _get(cfg, path, "head_dim", int, hidden // heads if heads else 0)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path}: hidden_act={act!r} is not supported (only 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{path}: {key}={cfg[key]!r} is not supported (only Qwen2's q/k/v "
                             "biases are)")
    window, layer_types = _layer_kinds(cfg, path, model_type, layers)
    max_pos = _get(cfg, path, "max_position_embeddings", int, 4096)
    fields = dict(
        vocab_size=_get(cfg, path, "vocab_size", int),
        d_model=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_dim=_get(cfg, path, "intermediate_size", int),
        max_seq_len=max_pos,
        norm_eps=_get(cfg, path, "rms_norm_eps", float, 1e-6),
        dtype=dtype,
        tie_embeddings=_get(cfg, path, "tie_word_embeddings", bool, False),
        qkv_bias=model_type == "qwen2",
        sliding_window=window,
        layer_types=layer_types,
        **_rope(cfg, path),
    )
    try:
        config = LlamaConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return HFModel(directory, arch, config, window, cfg)
