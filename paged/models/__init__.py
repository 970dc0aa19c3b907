"""Llama-style decoder (Flax Linen), byte tokenizer and the bundled tiny models.

``load_model("tiny") -> (LlamaConfig, params)``; ``Llama(config).apply(params, ...)`` serves from paged
KV (see `paged.models.llama`), ``method="dense"`` trains. Hugging Face checkpoints (Llama, Mistral,
Qwen2 safetensors directories): ``load_checkpoint(path, dtype="float32") -> (LlamaConfig, params)``
and ``load_tokenizer(path, vocab_size)``; `IncrementalDecoder` streams text without splitting a
character.
"""

from paged.models.attention import AttentionMetadata, PagedAttention, build_metadata
from paged.models.config import LlamaConfig
from paged.models.hf import is_checkpoint_dir, load_checkpoint
from paged.models.hf_tokenizer import (
    HFTokenizer,
    IncrementalDecoder,
    TokenIdsOnly,
    load_tokenizer,
)
from paged.models.llama import Llama
from paged.models.registry import (
    KNOWN_MODELS,
    init_params,
    load_any,
    load_model,
    model_info,
)
from paged.models.tokenizer import ByteTokenizer

__all__ = [
    "KNOWN_MODELS",
    "AttentionMetadata",
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDecoder",
    "Llama",
    "LlamaConfig",
    "PagedAttention",
    "TokenIdsOnly",
    "build_metadata",
    "init_params",
    "is_checkpoint_dir",
    "load_any",
    "load_checkpoint",
    "load_model",
    "load_tokenizer",
    "model_info",
]
