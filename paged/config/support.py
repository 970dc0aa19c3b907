"""The support matrix: which engine mechanisms may be combined.

A mechanism is a named feature of one engine build, derived from its ``EngineConfig``, the
model's layer windows and where it runs (`features`). ``REFUSED`` is the one table of pairs that
may not be combined, each with its reason; `check_supported` refuses the first such pair with a
ValueError naming both mechanisms. Every pair not in the table is supported.

``EngineConfig`` calls `check_supported` (settings only), and so do ``Engine`` /
``DataParallelEngine`` (with the model and whether the devices span processes), the server's
engine-core replicas and the simulator's replicas, so a refused pair fails at construction,
before any state changes. A new mechanism is a row of ``MECHANISMS`` and a line of `features`;
a new refusal is a row of ``REFUSED``. Imports nothing of the package: the configs are read by
their fields (duck typing), the model by its ``layer_windows``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Mechanism:
    """One mechanism: its name, how it is turned on, how it is turned off, and ``shown``:
    ``(config, model) -> str``, the setting as this build has it (for messages)."""

    name: str
    on: str
    off: str
    shown: Callable


@dataclass(frozen=True)
class Refusal:
    """``a`` with ``b`` is refused: ``a`` needs ``b`` off, for ``reason``."""

    a: str
    b: str
    reason: str


def _windows(model) -> tuple:
    return tuple(getattr(model, "layer_windows", (None,)) or (None,))


def _spec(config) -> str:
    s = config.speculative
    return f"speculative method={s.method!r}" if s is not None else "speculative=None"


def _model_windows(config, model) -> str:
    w = sorted({x for x in _windows(model) if x is not None})
    kinds = "every layer slides" if None not in _windows(model) else "full and sliding layers"
    return f"a model with sliding-window layers (sliding_window={w[0] if w else None}, {kinds})"


MECHANISMS: dict[str, Mechanism] = {m.name: m for m in (
    Mechanism("quantized_kv", "kv_cache_dtype='int8' / 'fp8_e4m3' / 'fp8_e5m2' / 'int4' / 'int2'",
       "kv_cache_dtype='auto'", lambda c, m: f"kv_cache_dtype={c.kv_cache_dtype!r}"),
    Mechanism("packed_kv", "kv_cache_dtype='int4' / 'int2' (KIVI pages, open page in dtype)",
       "kv_cache_dtype='auto', 'int8' or 'fp8_*'",
       lambda c, m: f"kv_cache_dtype={c.kv_cache_dtype!r}"),
    Mechanism("contiguous_layout", "kv_layout='contiguous'", "kv_layout='paged'",
       lambda c, m: f"kv_layout={c.kv_layout!r}"),
    Mechanism("static_scheduling", "scheduling='static'", "scheduling='continuous'",
       lambda c, m: f"scheduling={c.scheduling!r}"),
    Mechanism("cache_aware_scheduling", "policy='lpm' or 'dfs-weight'",
       "policy='decode-first' or 'prefill-first'", lambda c, m: f"policy={c.policy!r}"),
    Mechanism("no_prefix_caching", "enable_prefix_caching=False", "enable_prefix_caching=True",
       lambda c, m: f"enable_prefix_caching={c.enable_prefix_caching}"),
    Mechanism("swap", "preemption_mode='swap'", "preemption_mode='recompute'",
       lambda c, m: f"preemption_mode={c.preemption_mode!r}"),
    Mechanism("async_scheduling", "async_scheduling=True", "async_scheduling=False",
       lambda c, m: f"async_scheduling={c.async_scheduling}"),
    Mechanism("speculative", "speculative=SpeculativeConfig(...)", "speculative=None",
       lambda c, m: _spec(c)),
    Mechanism("draft", "speculative method='draft'", "speculative method='ngram' or speculative=None",
       lambda c, m: _spec(c)),
    Mechanism("ngram", "speculative method='ngram'", "speculative method='draft' or speculative=None",
       lambda c, m: _spec(c)),
    Mechanism("host_tier", "host_kv_cache_bytes > 0", "host_kv_cache_bytes=0",
       lambda c, m: f"host_kv_cache_bytes={c.host_kv_cache_bytes}"),
    Mechanism("disaggregation", "prefill_replicas > 0", "prefill_replicas=0",
       lambda c, m: f"prefill_replicas={c.prefill_replicas}" if c.prefill_replicas
       else "prefill/decode replica roles"),
    Mechanism("data_parallel", "data_parallel_size > 1", "data_parallel_size=1",
       lambda c, m: f"data_parallel_size={c.data_parallel_size}"),
    Mechanism("tensor_parallel", "tensor_parallel_size > 1", "tensor_parallel_size=1",
       lambda c, m: f"tensor_parallel_size={c.tensor_parallel_size}"),
    Mechanism("cascade", "cascade_attention='on' or 'auto'", "cascade_attention='off'",
       lambda c, m: f"cascade_attention={c.cascade_attention!r}"),
    Mechanism("sliding_window", "a model with sliding-window layers",
       "a model without sliding-window layers", _model_windows),
    Mechanism("window_recycling", "a model whose every layer slides, kv_layout='paged' (blocks behind "
       "the window are recycled)", "a model with full-attention layers",
       _model_windows),
    Mechanism("kv_groups", "a model with full and sliding layers, kv_layout='paged' (KV-cache groups)",
       "a model whose layers all slide or none does", _model_windows),
    Mechanism("sparse_decode", "sparse_decode=SparseDecodeConfig(...)", "sparse_decode=None",
       lambda c, m: f"sparse_decode={c.sparse_decode!r}"),
    Mechanism("multi_process", "the engine's devices span several processes (jax.distributed)",
       "the engine's devices in one process", lambda c, m: "devices spanning processes"),
    Mechanism("prefix_eviction", "prefix_eviction other than 'lru'", "prefix_eviction='lru'",
       lambda c, m: f"prefix_eviction={c.prefix_eviction!r}"),
    Mechanism("kv_policy", "kv_policy=KVPolicyConfig(...)", "kv_policy=None",
       lambda c, m: f"kv_policy method={c.kv_policy.method!r}" if c.kv_policy is not None
       else "kv_policy=None"),
    Mechanism("engine_processes", "engine-core processes (the server's --engine_process)",
       "the replicas in one process: serve without engine-core processes",
       lambda c, m: "engine-core processes"),
)}


REFUSED: tuple[Refusal, ...] = (
    # Settings only (EngineConfig refuses these itself).
    Refusal("host_tier", "contiguous_layout", "the host tier is a second tier of the paged "
            "pool's prefix cache: it keeps whole blocks"),
    Refusal("host_tier", "no_prefix_caching", "host-tier blocks are found again by their prefix "
            "key, which only the prefix cache computes"),
    Refusal("cache_aware_scheduling", "no_prefix_caching", "its order ranks waiting requests "
            "by what the prefix cache holds for them"),
    Refusal("disaggregation", "contiguous_layout", "the hand-over moves a request's pages by its "
            "block table"),
    Refusal("disaggregation", "static_scheduling", "decode replicas take each request as its "
            "prefill ends; a static batch waits for all of it"),
    Refusal("disaggregation", "speculative", "the hand-over moves the target's KV only, not the "
            "proposer's state"),
    Refusal("disaggregation", "host_tier", "a host-tier load on either side is not part of the "
            "hand-over's rules yet"),
    Refusal("prefix_eviction", "no_prefix_caching", "an eviction policy orders the prefix "
            "cache's blocks; without the cache it would do nothing"),
    Refusal("prefix_eviction", "contiguous_layout", "the contiguous layout has no prefix cache "
            "to evict from"),
    Refusal("sparse_decode", "contiguous_layout", "selection picks pages of a block table"),
    Refusal("sparse_decode", "speculative", "verification rows are several tokens of one "
            "sequence; selection serves one query row per sequence"),
    Refusal("sparse_decode", "cascade", "cascade reads a shared prefix whole; a selection reads "
            "pages per sequence and KV head"),
    Refusal("sparse_decode", "tensor_parallel", "the selected pages are addressed in a one-head "
            "view of the pool, which a KV-head-sharded pool does not have"),
    # Packed (int4 / int2, KIVI) pages: an open page lives in a slot beside the pool
    # (paged.kv.open_pages) that copy-on-write and swap move, nothing else yet.
    Refusal("packed_kv", "speculative", "a rejected draft may fill a page, which is then "
            "quantized with tokens that a rollback cannot take back"),
    Refusal("packed_kv", "cascade", "the cascade kernel reads unpacked pages"),
    Refusal("packed_kv", "contiguous_layout", "a contiguous buffer is one page of max_model_len: "
            "the whole sequence would be its open page"),
    Refusal("packed_kv", "disaggregation", "the hand-over moves pool pages, not the open page's "
            "slot"),
    Refusal("packed_kv", "tensor_parallel", "the open-page buffer is not placed per KV-head "
            "shard yet (untested across devices)"),
    Refusal("packed_kv", "multi_process", "the open-page slots are host state of one process"),
    Refusal("packed_kv", "data_parallel", "each replica would plan its own open pages; not "
            "tested across replicas yet"),
    # With the model's windows.
    Refusal("packed_kv", "sparse_decode", "packed pages keep no key bounds: the open page's "
            "keys are not yet quantized and a closed page's bounds are not written on close"),
    Refusal("packed_kv", "sliding_window", "a sliding layer has no quantize-on-fill reference "
            "and its window mask is not in the packed kernel"),
    Refusal("sparse_decode", "sliding_window", "windows already bound what a row reads; the "
            "selection has no window mask"),
    # KV policies (paged.kv.policies): survivors are compacted inside a sequence's own pages.
    Refusal("kv_policy", "sparse_decode", "compaction rewrites pages without recomputing their "
            "key bounds yet"),
    Refusal("kv_policy", "contiguous_layout", "compaction frees whole pages of a block table; "
            "a contiguous buffer has none to free"),
    Refusal("kv_policy", "quantized_kv", "compaction moves tokens between pages; page-scaled "
            "values would need requantizing (not done yet)"),
    Refusal("kv_policy", "speculative", "a rollback of rejected drafts counts slots from the "
            "position; a compacted sequence's slots are fewer than its positions"),
    Refusal("kv_policy", "cascade", "the cascade planner groups sequences by identical leading "
            "pages and lengths; compacted tables break its prefix arithmetic"),
    Refusal("kv_policy", "disaggregation", "the hand-over moves a request's pages by position; "
            "the compacted slot offset is not part of it yet"),
    Refusal("kv_policy", "tensor_parallel", "the compaction's gather is not placed per shard "
            "yet (untested across devices)"),
    Refusal("kv_policy", "multi_process", "the compaction would run on every process's devices"),
    # With the model's windows.
    Refusal("kv_policy", "sliding_window", "a sliding window recycles blocks by position; a "
            "compacted block holds tokens of many positions"),
    Refusal("cascade", "sliding_window", "the cascade kernel reads the shared prefix whole: it "
            "has no window mask"),
    Refusal("draft", "window_recycling", "the draft's KV lives on the target's block tables and "
            "would lose the blocks recycled behind the window that it still attends to"),
    Refusal("draft", "kv_groups", "the grouped pool does not serve a draft model yet (its KV "
            "would need the grouped layout too)"),
    Refusal("host_tier", "window_recycling", "host-tier slots hold whole prefixes; a sliding "
            "model recycles the blocks behind its window"),
    Refusal("host_tier", "kv_groups", "the grouped pool does not serve the host tier yet"),
    Refusal("prefix_eviction", "kv_groups", "the grouped pool's groups share one pool but are "
            "not wired to a non-LRU eviction order yet"),
    Refusal("disaggregation", "window_recycling", "the hand-over does not move the blocks a "
            "sliding model recycles behind its window"),
    Refusal("disaggregation", "kv_groups", "the hand-over moves one block table per request; a "
            "grouped pool has one per group"),
    # Where the engine runs.
    Refusal("swap", "multi_process", "the swapped pages would have to be gathered from every "
            "process's devices"),
    Refusal("speculative", "multi_process", "proposals are host state of process 0 fed to a "
            "second model"),
    Refusal("host_tier", "multi_process", "host-tier copies would have to be gathered from every "
            "process's devices"),
    Refusal("sparse_decode", "multi_process", "the one-head view of the pool is not served "
            "across processes yet"),
    Refusal("kv_groups", "multi_process", "a grouped pool is not served across processes yet"),
    Refusal("disaggregation", "multi_process", "the hand-over moves device arrays within one "
            "process"),
    Refusal("disaggregation", "engine_processes", "the hand-over moves device arrays within one "
            "process"),
)


def features(config, model_config=None, *, processes: bool = False,
             engine_processes: bool = False, prefill_decode: bool = False) -> frozenset[str]:
    """The mechanisms one build turns on.

    Args:
      config: the ``EngineConfig``.
      model_config: anything with ``layer_windows`` (``LlamaConfig``, the simulator's
        ``ModelDims``); ``None``: the model is not known yet (no model mechanism).
      processes: the engine's devices span several processes.
      engine_processes: the replicas run in engine-core processes (the server).
      prefill_decode: a replica with a prefill or decode role (the simulator's roles).
    """
    spec, paged = config.speculative, config.kv_layout == "paged"
    on = {
        "quantized_kv": config.kv_cache_dtype != "auto",
        "packed_kv": config.kv_cache_dtype in ("int4", "int2"),
        "contiguous_layout": not paged,
        "static_scheduling": config.scheduling == "static",
        "no_prefix_caching": not config.enable_prefix_caching,
        "cache_aware_scheduling": config.policy in ("lpm", "dfs-weight"),
        "swap": config.preemption_mode == "swap",
        "async_scheduling": config.async_scheduling,
        "speculative": spec is not None,
        "draft": spec is not None and spec.method == "draft",
        "ngram": spec is not None and spec.method == "ngram",
        "host_tier": config.host_kv_cache_bytes > 0,
        "disaggregation": config.prefill_replicas > 0 or prefill_decode,
        "data_parallel": config.data_parallel_size > 1,
        "tensor_parallel": config.tensor_parallel_size > 1,
        "cascade": config.cascade_attention != "off",
        "sparse_decode": getattr(config, "sparse_decode", None) is not None,
        "multi_process": processes,
        "engine_processes": engine_processes,
        "prefix_eviction": getattr(config, "prefix_eviction", "lru") != "lru",
        "kv_policy": getattr(config, "kv_policy", None) is not None,
    }
    if model_config is not None:
        windows = _windows(model_config)
        sliding = any(w is not None for w in windows)
        on["sliding_window"] = sliding
        on["window_recycling"] = sliding and None not in windows and paged
        on["kv_groups"] = sliding and None in windows and paged
    return frozenset(name for name, v in on.items() if v)


def refusal_message(row: Refusal, config, model_config=None) -> str:
    """The ValueError text of ``row`` for this build: both settings, the reason, both names."""
    a, b = MECHANISMS[row.a], MECHANISMS[row.b]
    return (f"{a.shown(config, model_config)} needs {b.off} (got "
            f"{b.shown(config, model_config)}): {row.reason} [refused pair: {row.a} + "
            f"{row.b}]")


def check_supported(config, model_config=None, **where) -> None:
    """Refuses the first pair of ``REFUSED`` that this build turns on (``features``' arguments).

    Raises:
      ValueError: naming both mechanisms' settings and the reason.
    """
    on = features(config, model_config, **where)
    for row in REFUSED:
        if row.a in on and row.b in on:
            raise ValueError(refusal_message(row, config, model_config))


__all__ = ["MECHANISMS", "REFUSED", "Mechanism", "Refusal", "check_supported", "features",
           "refusal_message"]
