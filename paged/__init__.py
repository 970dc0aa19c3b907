"""paged: paged KV state for online LLM inference in JAX.

Public API (see DESIGN.md): ``accounting``, ``Engine``, ``EngineConfig``, ``SamplingParams``.
The engine names are imported lazily so that ``from paged import accounting`` stays light.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Engine": "paged.engine",
    "EngineConfig": "paged.config",
    "RequestOutput": "paged.engine",
    "SamplingParams": "paged.sampling",
}

__all__ = ["accounting", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "accounting":
        return importlib.import_module("paged.accounting")
    raise AttributeError(f"module 'paged' has no attribute {name!r}")
