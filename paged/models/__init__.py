"""Llama-style decoder (Flax Linen), byte tokenizer and the bundled tiny models.

``load_model("tiny") -> (LlamaConfig, params)``; ``Llama(config).apply(params, ...)`` serves from paged
KV (see `paged.models.llama`), ``method="dense"`` trains.
"""

from paged.models.attention import AttentionMetadata, PagedAttention, build_metadata
from paged.models.config import LlamaConfig
from paged.models.llama import Llama
from paged.models.registry import KNOWN_MODELS, init_params, load_model, model_info
from paged.models.tokenizer import ByteTokenizer

__all__ = [
    "KNOWN_MODELS",
    "AttentionMetadata",
    "ByteTokenizer",
    "Llama",
    "LlamaConfig",
    "PagedAttention",
    "build_metadata",
    "init_params",
    "load_model",
    "model_info",
]
