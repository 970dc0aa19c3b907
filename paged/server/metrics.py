"""Prometheus metrics of one server (its own `CollectorRegistry`, so several apps can coexist).

Names follow vLLM's with the ``paged:`` prefix (``--metrics_prefix vllm``: vLLM's own ``vllm:``):

- gauges ``paged:num_requests_running`` and ``paged:num_requests_waiting`` (engine sequences
  running / waiting, as the engine's ``kv_stats`` counts them; a request with ``n=2`` runs as two
  sequences once forked), ``paged:kv_cache_usage_perc`` (used KV blocks over usable blocks, the
  null page left out: a fraction in [0, 1]);
- counters ``paged:prefix_cache_hit_tokens_total``, ``paged:num_preemptions_total``,
  ``paged:prompt_tokens_total``, ``paged:generation_tokens_total`` and
  ``paged:request_success_total`` (label ``finished_reason``), ``paged:request_aborted_total``
  (client hung up, or stop strings ended every sample);
- the host KV tier (``kv_stats()["host_tier"]``; all zero without one): gauge
  ``paged:host_tier_usage_perc`` (used over all host-tier blocks), counters
  ``paged:host_tier_hit_tokens_total`` (the host tier's share of the prefix-cache hits),
  ``paged:host_tier_offloaded_bytes_total``, ``paged:host_tier_loaded_bytes_total`` and
  ``paged:host_tier_load_wait_seconds_total`` (time sequences waited in ``loading``, summed);
- histograms ``paged:time_to_first_token_seconds``, ``paged:time_per_output_token_seconds``
  (per request: (finish - first token) / (tokens - 1)), ``paged:e2e_request_latency_seconds``;
- residency (``kv_stats()["residency"]``, `paged.kv.blocks.residency`; label ``tier``:
  ``device`` or ``host``): histograms ``paged:kv_block_lifetime_seconds``,
  ``paged:kv_block_idle_before_evict_seconds``, ``paged:kv_block_reuse_gap_seconds`` (vLLM's
  names, vllm PR #27793) and ``paged:kv_block_reuse_distance_blocks``; counters
  ``paged:prefix_cache_queries`` / ``paged:prefix_cache_hits`` (tokens, device; vLLM's),
  ``paged:external_prefix_cache_queries`` / ``paged:external_prefix_cache_hits`` (the host tier,
  vLLM's names for the tier behind the device) and ``paged:kv_eviction_regret_blocks``.

The engine loop thread updates the gauges and counters after every step (`update_engine`) and
observes each finished request once (`observe_finished`); ``/metrics`` renders the registry.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


PREFIXES = ("paged", "vllm")


class ServerMetrics:
    """The registry and every metric of one server."""

    def __init__(self, prefix: str = "paged"):
        """``prefix``: ``"paged"`` or ``"vllm"`` (the names vLLM's dashboards expect)."""
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix={prefix!r} must be one of {PREFIXES}")
        p = prefix
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.running = Gauge(f"{p}:num_requests_running",
                             "Sequences running in the engine (one per sample).", registry=r)
        self.waiting = Gauge(f"{p}:num_requests_waiting",
                             "Sequences waiting in the engine, plus requests the server accepted "
                             "and has not handed to the engine yet.", registry=r)
        self.kv_usage = Gauge(f"{p}:kv_cache_usage_perc",
                              "Used KV blocks / usable blocks (0 to 1).", registry=r)
        self.prefix_hits = Counter(f"{p}:prefix_cache_hit_tokens",
                                   "Prompt tokens served from the prefix cache.", registry=r)
        self.preemptions = Counter(f"{p}:num_preemptions", "Engine preemptions.", registry=r)
        self.prompt_tokens = Counter(f"{p}:prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter(f"{p}:generation_tokens",
                                         "Output tokens of finished requests.", registry=r)
        self.success = Counter(f"{p}:request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=r)
        self.aborted = Counter(f"{p}:request_aborted",
                               "Requests aborted by the server: their client hung up.", registry=r)
        self.ttft = Histogram(f"{p}:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{p}:time_per_output_token_seconds",
                              "Time per output token after the first.", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram(f"{p}:e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._hits = self._preempts = 0
        self.host_usage = Gauge(f"{p}:host_tier_usage_perc",
                                "Fraction of host KV tier blocks in use.", registry=r)
        # kv_stats()["host_tier"] key -> counter fed its increments.
        self._host_counters = {
            key: Counter(f"{p}:host_tier_{name}", doc, registry=r) for key, name, doc in (
                ("hit_tokens", "hit_tokens", "Prompt tokens loaded from the host KV tier."),
                ("offloaded_bytes", "offloaded_bytes", "Bytes copied to the host KV tier."),
                ("loaded_bytes", "loaded_bytes", "Bytes loaded from the host KV tier."),
                ("load_wait_s", "load_wait_seconds",
                 "Seconds sequences waited for host KV tier loads."))}
        self._host_seen = dict.fromkeys(self._host_counters, 0)
        self.residency: dict = {}  # kv_stats()["residency"] at the last update
        r.register(_ResidencyCollector(self, p))

    def update_engine(self, engine, pending: int = 0) -> dict:
        """Gauges and counters from ``engine.kv_stats()`` (call from the engine's thread);
        returns the stats."""
        s = engine.kv_stats()
        self.running.set(s["num_running"])
        self.waiting.set(s["num_waiting"] + pending)
        usable = max(s["num_blocks"] - 1, 1)
        self.kv_usage.set(s["num_used_blocks"] / usable)
        hits, preempts = s["prefix_cache_hit_tokens"], s["num_preemptions"]
        if hits > self._hits:
            self.prefix_hits.inc(hits - self._hits)
        if preempts > self._preempts:
            self.preemptions.inc(preempts - self._preempts)
        self._hits, self._preempts = hits, preempts
        self.residency = s.get("residency") or {}
        tier = s.get("host_tier", {})
        self.host_usage.set(tier.get("used_blocks", 0) / max(tier.get("num_blocks", 0), 1))
        for key, counter in self._host_counters.items():
            value = tier.get(key, 0)
            if value > self._host_seen[key]:
                counter.inc(value - self._host_seen[key])
                self._host_seen[key] = value
        return s

    def observe_finished(self, out, reason: str) -> None:
        """One finished request (a `RequestOutput`; ``reason``: the finish reason reported)."""
        arrival, first, finish = out.arrival_time, out.first_token_time, out.finish_time
        n = len(out.token_ids)
        self.success.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(o.token_ids) for o in out.outputs))
        if first is not None and arrival is not None:
            self.ttft.observe(max(first - arrival, 0.0))
            if finish is not None and n > 1:
                self.tpot.observe(max(finish - first, 0.0) / (n - 1))
        if finish is not None and arrival is not None:
            self.e2e.observe(max(finish - arrival, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


_HISTOGRAMS = (("kv_block_lifetime_seconds", "Seconds from a prefix-cache block's store to its "
                "removal."),
               ("kv_block_idle_before_evict_seconds", "Seconds from a block's last access to "
                "its removal."),
               ("kv_block_reuse_gap_seconds", "Seconds between consecutive accesses of a block."),
               ("kv_block_reuse_distance_blocks", "Block accesses between consecutive accesses "
                "of a block."))


class _ResidencyCollector:
    """The residency figures of the last ``update_engine`` as Prometheus families."""

    def __init__(self, metrics: ServerMetrics, prefix: str):
        self.metrics, self.p = metrics, prefix

    def describe(self):
        return []

    def collect(self):
        p, res = self.p, self.metrics.residency
        for name, doc in _HISTOGRAMS:
            fam = HistogramMetricFamily(f"{p}:{name}", doc, labels=["tier"])
            for tier, r in sorted(res.items()):
                h = r[name]
                cum, buckets = 0, []
                for bound, c in h["buckets"].items():
                    cum += c
                    buckets.append((bound, cum))
                fam.add_metric([tier], buckets, h["sum"])
            yield fam
        for name, tier, key, doc in (
                ("prefix_cache_queries", "device", "query_tokens", "Prompt tokens looked up in "
                 "the device prefix cache."),
                ("prefix_cache_hits", "device", "hit_tokens", "Prompt tokens the device prefix "
                 "cache held."),
                ("external_prefix_cache_queries", "host", "query_tokens", "Prompt tokens looked "
                 "up in the host tier (after the device's hits)."),
                ("external_prefix_cache_hits", "host", "hit_tokens", "Prompt tokens the host tier "
                 "held.")):
            fam = CounterMetricFamily(f"{p}:{name}", doc)
            fam.add_metric([], float(res.get(tier, {}).get(key, 0)))
            yield fam
        fam = CounterMetricFamily(f"{p}:kv_eviction_regret_blocks", "Blocks stored again after "
                                  "their tier removed them (device: recomputed).", labels=["tier"])
        for tier, r in sorted(res.items()):
            fam.add_metric([tier], float(r["eviction_regret_blocks"]))
        yield fam
