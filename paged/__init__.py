"""paged: paged KV state for online LLM inference in JAX.

The public names, imported lazily so that ``from paged import accounting`` stays light:
``Engine`` / ``EngineConfig`` / ``SamplingParams`` / ``SpeculativeConfig`` / ``RequestOutput``
(requests in, tokens out), ``DataParallelEngine``, ``BlockManager`` / ``KVCache`` (the host
pages and the device pool), ``Workload`` / ``make_workload`` / ``load_azure_trace`` /
``check_same_evidence`` / ``RequestSpec`` (traffic), ``Simulator`` and ``accounting`` (exact KV
byte and position accounting). WORKSPACE.md is the map of the packages behind them.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Engine": "paged.engine.engine",
    "RequestOutput": "paged.request.outputs",
    "CompletionOutput": "paged.request.outputs",
    "DataParallelEngine": "paged.engine.data_parallel",
    "EngineConfig": "paged.config.engine_config",
    "SpeculativeConfig": "paged.config.speculative",
    "SamplingParams": "paged.request.sampling",
    "BlockManager": "paged.kv.block_manager",
    "KVCache": "paged.kv.cache",
    "MemoryLedger": "paged.accounting.ledger",
    "Workload": "paged.workload.workload",
    "make_workload": "paged.workload.workload",
    "load_azure_trace": "paged.workload.workload",
    "RequestSpec": "paged.workload.request_spec",
    "check_same_evidence": "paged.workload.evidence",
    "Simulator": "paged.sim.simulator",
}

__all__ = ["accounting", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "accounting":
        return importlib.import_module("paged.accounting")
    raise AttributeError(f"module 'paged' has no attribute {name!r}")
