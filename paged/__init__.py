"""paged: paged KV state for online LLM inference in JAX.

Public API: ``accounting`` (exact KV byte and position accounting), ``Engine`` (requests in,
tokens out), ``EngineConfig`` (every engine setting), ``SamplingParams``, ``SpeculativeConfig`` and
``RequestOutput``;
``paged.validate`` holds the argument checks they share. The engine names are imported lazily so
that ``from paged import accounting`` stays light.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Engine": "paged.engine",
    "EngineConfig": "paged.config",
    "RequestOutput": "paged.engine",
    "SamplingParams": "paged.sampling",
    "SpeculativeConfig": "paged.spec_decode",
}

__all__ = ["accounting", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "accounting":
        return importlib.import_module("paged.accounting")
    raise AttributeError(f"module 'paged' has no attribute {name!r}")
