"""`LlamaConfig`: the one typed definition of a decoder's shape."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_DTYPES = ("float32", "bfloat16", "float16")
ROPE_SCALINGS = ("none", "linear", "llama3")
# Hugging Face's names of the per-layer attention kinds this decoder runs.
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU).

    Attributes:
      vocab_size: number of token ids.
      d_model: width of the residual stream.
      num_layers: number of decoder blocks.
      num_heads: query heads.
      num_kv_heads: key/value heads; ``num_heads % num_kv_heads == 0`` (GQA; 1 is MQA).
      head_dim: width of one head, any even size. The XLA attention path takes every size; the
        Pallas kernels have their own rules (GPU: a power of two >= 16, TPU: a multiple of 64) and
        ``attention_impl="auto"`` serves other sizes with the XLA path.
      ffn_dim: hidden width of the SwiGLU MLP.
      rope_theta: RoPE base.
      max_seq_len: longest position the model is meant for (positions are not clipped; this is
        what the engine may use as ``max_model_len``).
      norm_eps: RMSNorm epsilon.
      dtype: compute dtype name ("float32", "bfloat16", "float16"); params stay float32 and logits
        are always float32.
      tie_embeddings: the LM head reuses the token embedding (transposed).
      qkv_bias: the q/k/v projections have biases (Qwen2); off for the bundled models.
      rope_scaling: how RoPE frequencies are rescaled for long contexts, as Hugging Face defines
        it: "none"; "linear" (positions divided by ``rope_factor``); "llama3" (wavelengths longer
        than ``rope_original_max_len / rope_low_freq_factor`` divided by ``rope_factor``, shorter
        than ``rope_original_max_len / rope_high_freq_factor`` kept, smooth in between).
      rope_factor: the scaling factor of "linear" and "llama3".
      rope_low_freq_factor: "llama3" only.
      rope_high_freq_factor: "llama3" only.
      rope_original_max_len: "llama3" only: the context length the model was pretrained with.
      sliding_window: W of the layers of kind "sliding_attention": the token at position ``p``
        attends to positions ``[p - W + 1, p]`` only (Hugging Face's meaning). None: no window.
      layer_types: one kind per layer, "full_attention" or "sliding_attention" (Hugging Face's
        ``layer_types``). None means every layer slides when ``sliding_window`` is set, else every
        layer is full (Mistral's reading).
    """

    vocab_size: int = 258
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    ffn_dim: int = 704
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    dtype: str = "float32"
    tie_embeddings: bool = True
    qkv_bias: bool = False
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_dim",
            "max_seq_len",
            "rope_original_max_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if not self.rope_theta > 1.0:
            raise ValueError(f"rope_theta={self.rope_theta!r} must be > 1")
        if not self.norm_eps > 0.0:
            raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {_DTYPES}")
        for name in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be one of {ROPE_SCALINGS}")
        if not self.rope_factor >= 1.0:
            raise ValueError(f"rope_factor={self.rope_factor!r} must be >= 1")
        self._check_windows()
        if not 0.0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"rope_low_freq_factor={self.rope_low_freq_factor!r} and rope_high_freq_factor="
                f"{self.rope_high_freq_factor!r} must satisfy 0 < low < high"
            )

    def _check_windows(self) -> None:
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window={w!r} must be None or a positive int")
        if self.layer_types is None:
            return
        if isinstance(self.layer_types, str) or not hasattr(self.layer_types, "__iter__"):
            raise ValueError(f"layer_types={self.layer_types!r} must be a sequence of "
                             f"{LAYER_TYPES}")
        types = tuple(self.layer_types)
        object.__setattr__(self, "layer_types", types)  # a list from JSON: hashable again
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for "
                             f"num_layers={self.num_layers}")
        bad = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
        if bad:
            raise ValueError(f"layer_types {bad} cannot run here; supported: {LAYER_TYPES}")
        if SLIDING in types and w is None:
            raise ValueError("layer_types has 'sliding_attention' layers but sliding_window is None")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer (None: full attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def rope(self) -> tuple:
        """``(theta, scaling, factor, low_freq_factor, high_freq_factor, original_max_len)``: the
        hashable RoPE description `paged.models.layers.apply_rope` takes."""
        return (self.rope_theta, self.rope_scaling, self.rope_factor, self.rope_low_freq_factor,
                self.rope_high_freq_factor, self.rope_original_max_len)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        """JSON-ready dict; ``LlamaConfig(**d)`` rebuilds it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        """Builds a config from ``to_dict`` output; unknown keys -> ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown LlamaConfig keys {unknown}; known: {sorted(names)}")
        return cls(**d)
