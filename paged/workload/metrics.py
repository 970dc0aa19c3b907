"""Serving metrics: per-request latencies, aggregates, goodput, and per-step traces.

Per request (all times in seconds on one clock):

- TTFT = first token - arrival.
- TPOT = (E2E - TTFT) / (output tokens - 1); undefined for a 1-token output, which is left out of
  the TPOT population and counted (``num_tpot_undefined``).
- ITL = gaps between consecutive output tokens (pooled over requests, as vLLM does).
- E2E = finish - arrival.  Queue time = first scheduled - arrival.

`summarize` writes vLLM's ``benchmarks/benchmark_serving.py`` result fields under vLLM's names, so
scripts that read vLLM's JSON read ours: ``duration``, ``completed``, ``total_input_tokens``,
``total_output_tokens``, ``request_throughput``, ``output_throughput``, ``total_token_throughput``,
``request_goodput``, ``{mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms``, and the per-request arrays
``input_lens``, ``output_lens``, ``ttfts`` (seconds), ``itls`` (a list of token gaps in seconds per
request) and ``errors``, one entry per request in record order. In those arrays, as vLLM writes
them, a request that did not finish has ``output_lens`` 0, ``errors`` its status (``"aborted"``,
``"timeout"``, ``"rejected"``; ``""`` when it finished), ``ttfts`` its TTFT if it got a first token
and 0.0 otherwise, and ``itls`` its gaps so far. Our own fields sit beside them (``num_requests``,
``p90_*``, ``queue`` statistics, populations, failure counts, cache hits). Aborted, timed out and
rejected requests stay in the result: counted, listed in ``failed_request_ids``, but the latency
statistics are over finished requests only and ``latency_population`` says so. Statistics of an
empty population are None, never 0. Percentiles are ``np.percentile`` (linear interpolation), std is
the population std (``ddof=0``), as in vLLM.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from paged.workload.workload import EVIDENCE

STATUSES = ("finished", "aborted", "timeout", "rejected")
_STATS = ("mean", "median", "std", "p90", "p99")


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """What happened to one request.

    Attributes:
      request_id: the request's id.
      status: ``"finished" | "aborted" | "timeout" | "rejected"``.
      arrival_s: arrival time.
      first_scheduled_s: first time the scheduler ran it (None if never).
      first_token_s: time of its first output token (None if none).
      finish_s: time it finished or was dropped (None if rejected on arrival).
      token_times: the time of each output token, non-decreasing; empty if not recorded. When
        given for a finished request it has ``output_len`` entries, the first at ``first_token_s``.
      prompt_len: prompt tokens.
      output_len: output tokens produced.
      num_preemptions: times it was preempted.
      num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    status: str
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finish_s: float | None
    token_times: tuple[float, ...]
    prompt_len: int
    output_len: int
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r} must be one of {STATUSES}")
        for name in ("prompt_len", "output_len", "num_preemptions", "num_cached_tokens"):
            _check_count(name, getattr(self, name))
        times = list(map(float, self.token_times))
        # A list equal to its sorted copy has no time below the one before it (``sorted`` of
        # sorted floats is one linear pass); only a list that differs (or holds a NaN, which
        # compares false) is checked pair by pair.
        if sorted(times) != times and any(map(operator.gt, times, times[1:])):
            raise ValueError(f"request {self.request_id!r}: token_times={tuple(times)} not "
                             "non-decreasing")
        object.__setattr__(self, "token_times", tuple(times))
        self._check_order()
        if self.status == "finished":
            self._check_finished()

    def _check_order(self):
        if self.arrival_s is None:
            raise ValueError(f"request {self.request_id!r}: arrival_s is required")
        points = [("arrival_s", self.arrival_s), ("first_scheduled_s", self.first_scheduled_s),
                  ("first_token_s", self.first_token_s), ("finish_s", self.finish_s)]
        points = [(n, t) for n, t in points if t is not None]
        for name, t in points:
            if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t):
                raise ValueError(f"request {self.request_id!r}: {name}={t!r} must be finite")
        for (n0, t0), (n1, t1) in itertools.pairwise(points):
            if t1 < t0:
                raise ValueError(f"request {self.request_id!r}: {n1}={t1} < {n0}={t0}")

    def _check_finished(self):
        rid = self.request_id
        for name in ("first_scheduled_s", "first_token_s", "finish_s"):
            if getattr(self, name) is None:
                raise ValueError(f"finished request {rid!r} needs {name}")
        if self.output_len < 1:
            raise ValueError(f"finished request {rid!r} has output_len={self.output_len} < 1")
        times = self.token_times
        if times and len(times) != self.output_len:
            raise ValueError(f"request {rid!r}: {len(times)} token_times for "
                             f"output_len={self.output_len}")
        if times and (not math.isclose(times[0], self.first_token_s, abs_tol=1e-9)
                      or times[-1] > self.finish_s + 1e-9):
            raise ValueError(f"request {rid!r}: token_times [{times[0]}, {times[-1]}] does not "
                             f"start at first_token_s={self.first_token_s} and end by "
                             f"finish_s={self.finish_s}")

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2el_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output_len - 1); None if undefined (1 output token, or not finished)."""
        if self.status != "finished" or self.output_len < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_len - 1)

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Gaps between consecutive output tokens."""
        times = self.token_times
        return tuple(map(operator.sub, times[1:], times))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (every field is a scalar but ``token_times``: a shallow dict equals
        ``dataclasses.asdict``'s deep copy, at a fraction of its cost)."""
        d = {name: getattr(self, name) for name in _RECORD_FIELDS}
        d["token_times"] = list(self.token_times)
        return d


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < 0:
        raise ValueError(f"{name}={value!r} must be >= 0")
    return int(value)


def _check_slo(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a number > 0 (milliseconds) or None")
    return float(value)


def stats_ms(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """``mean/median/std/p90/p99_<name>_ms`` of ``values_s`` (seconds); all None when empty."""
    if len(values_s) == 0:
        return {f"{s}_{name}_ms": None for s in _STATS}
    x = np.asarray(values_s, dtype=np.float64) * 1000.0
    median, p90, p99 = np.percentile(x, [50, 90, 99])
    vals = (x.mean(), median, x.std(), p90, p99)
    return {f"{s}_{name}_ms": float(v) for s, v in zip(_STATS, vals, strict=True)}


def meets_slo(record: RequestRecord, *, ttft_slo_ms: float | None,
              tpot_slo_ms: float | None) -> bool:
    """A finished request whose TTFT and TPOT are within the SLOs (an undefined TPOT passes)."""
    if record.status != "finished":
        return False
    if ttft_slo_ms is not None and record.ttft_s * 1000.0 > ttft_slo_ms:
        return False
    tpot = record.tpot_s
    return tpot_slo_ms is None or tpot is None or tpot * 1000.0 <= tpot_slo_ms


def summarize(records: Iterable[RequestRecord], *, duration_s: float,
              ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
              evidence: str | None = None) -> dict[str, Any]:
    """Aggregates request records into one JSON-ready dict.

    Args:
      records: one per request, finished or not.
      duration_s: wall time of the run (the throughput denominator), > 0.
      ttft_slo_ms: TTFT SLO for goodput; None = no TTFT bound.
      tpot_slo_ms: TPOT SLO for goodput; None = no TPOT bound.
      evidence: the workload's label, echoed into the result if given.

    Returns:
      ``duration`` (seconds), counts, throughputs,
      ``{mean,median,std,p90,p99}_{ttft,tpot,itl,e2el,queue}_ms``, populations, failures,
      ``request_goodput`` (finished requests meeting both SLOs per second; None when no SLO is
      given) and vLLM's per-request arrays (module docstring).

    Raises:
      ValueError / TypeError: duplicate ids, duration_s <= 0, a bad SLO or evidence label.
    """
    records = list(records)
    for r in records:
        if not isinstance(r, RequestRecord):
            raise TypeError(f"records must be RequestRecord, got {type(r).__name__}")
    _check_unique(records)
    if isinstance(duration_s, bool) or not isinstance(duration_s, numbers.Real) or not (
            duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration_s={duration_s!r} must be finite and > 0")
    ttft_slo_ms = _check_slo("ttft_slo_ms", ttft_slo_ms)
    tpot_slo_ms = _check_slo("tpot_slo_ms", tpot_slo_ms)
    if evidence is not None and evidence not in EVIDENCE:
        raise ValueError(f"evidence={evidence!r} must be one of {EVIDENCE}")

    done = [r for r in records if r.status == "finished"]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    gaps, itls = _token_gaps(records)
    in_tok = sum(r.prompt_len for r in done)
    out_tok = sum(r.output_len for r in done)
    cached = sum(r.num_cached_tokens for r in done)
    out = {
        **({"evidence": evidence} if evidence is not None else {}),
        "duration": float(duration_s), "num_requests": len(records), "completed": len(done),
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(done) / duration_s, "output_throughput": out_tok / duration_s,
        "total_token_throughput": (in_tok + out_tok) / duration_s,
        "latency_population": f"finished requests only ({len(done)} of {len(records)})",
        "tpot_population": f"finished requests with output_len > 1 ({len(tpots)} of {len(done)})",
        "itl_population": f"token gaps of finished requests ({len(itls)} gaps)",
        "num_tpot_undefined": sum(1 for r in done if r.output_len < 2),
        **stats_ms("ttft", [r.ttft_s for r in done]), **stats_ms("tpot", tpots),
        **stats_ms("itl", itls), **stats_ms("e2el", [r.e2el_s for r in done]),
        **stats_ms("queue", [r.queue_s for r in done]),
        **_failures(records), **_goodput(done, duration_s, ttft_slo_ms, tpot_slo_ms),
        "num_preemptions": sum(r.num_preemptions for r in records),
        "total_cached_tokens": cached,
        "prefix_cache_hit_rate": cached / in_tok if in_tok else None,
        **per_request_arrays(records, gaps),
    }
    return out


def _token_gaps(records: Sequence[RequestRecord]) -> tuple[list[list[float]], np.ndarray]:
    """Each record's ``itl_s`` as a list, and the finished records' gaps pooled in record order:
    one array of every token time, one ``np.diff`` (the same float subtractions as ``itl_s``)."""
    lens = [len(r.token_times) for r in records]
    flat = np.fromiter(itertools.chain.from_iterable(r.token_times for r in records),
                       np.float64, count=sum(lens))
    diff = np.diff(flat)
    gaps, pooled = [], []
    o = 0
    for r, n in zip(records, lens, strict=True):
        if n > 1:
            g = diff[o:o + n - 1]
            gaps.append(g.tolist())
            if r.status == "finished":
                pooled.append(g)
        else:
            gaps.append([])
        o += n
    return gaps, np.concatenate(pooled) if pooled else np.zeros(0)


def per_request_arrays(records: Sequence[RequestRecord],
                       itls: Sequence[Sequence[float]] | None = None) -> dict[str, list]:
    """vLLM's per-request result arrays, one entry per record (module docstring); ``itls``:
    each record's ``itl_s``, if computed already."""
    done = [r.status == "finished" for r in records]
    if itls is None:
        itls = [r.itl_s for r in records]
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len if ok else 0 for r, ok in zip(records, done, strict=True)],
        "ttfts": [r.ttft_s if r.ttft_s is not None else 0.0 for r in records],
        "itls": [list(g) for g in itls],
        "errors": ["" if ok else r.status for r, ok in zip(records, done, strict=True)],
    }


def _check_unique(records: list[RequestRecord]) -> None:
    seen = set()
    for r in records:
        if r.request_id in seen:
            raise ValueError(f"duplicate request_id={r.request_id!r} in records")
        seen.add(r.request_id)


def _failures(records: list[RequestRecord]) -> dict[str, Any]:
    return {
        "num_aborted": sum(r.status == "aborted" for r in records),
        "num_timeout": sum(r.status == "timeout" for r in records),
        "num_rejected": sum(r.status == "rejected" for r in records),
        "failed_request_ids": [r.request_id for r in records if r.status != "finished"],
    }


def _goodput(done, duration_s, ttft_slo_ms, tpot_slo_ms) -> dict[str, Any]:
    if ttft_slo_ms is None and tpot_slo_ms is None:
        return {"request_goodput": None, "num_good": None, "ttft_slo_ms": None,
                "tpot_slo_ms": None}
    good = sum(meets_slo(r, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms) for r in done)
    return {"request_goodput": good / duration_s, "num_good": good, "ttft_slo_ms": ttft_slo_ms,
            "tpot_slo_ms": tpot_slo_ms}


# --- per-step traces -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TraceSample:
    """One engine step: queue sizes, batch tokens and KV bytes per ledger category."""

    time_s: float
    num_running: int
    num_waiting: int
    num_swapped: int
    batch_tokens: int
    ledger: Mapping[str, int]


class Trace:
    """Per-step samples over time, returned as JSON-ready column lists for plotting.

    The first sample fixes the ledger categories; every later sample must carry the same ones, so
    a stacked plot of KV usage by category never has holes.
    """

    def __init__(self):
        self._samples: list[TraceSample] = []

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def samples(self) -> tuple[TraceSample, ...]:
        return tuple(self._samples)

    def record(self, time_s: float, *, num_running: int, num_waiting: int, batch_tokens: int,
               num_swapped: int = 0, ledger: Mapping[str, int] | None = None) -> None:
        """Appends one sample; checks everything before appending.

        Raises:
          ValueError / TypeError: time going backwards or not finite, negative counts, ledger
            categories that differ from the first sample's.
        """
        if isinstance(time_s, bool) or not isinstance(time_s, numbers.Real) or not math.isfinite(
                time_s):
            raise ValueError(f"time_s={time_s!r} must be a finite number")
        if self._samples and time_s < self._samples[-1].time_s:
            raise ValueError(f"time_s={time_s} < previous {self._samples[-1].time_s}")
        counts = {n: _check_count(n, v) for n, v in (
            ("num_running", num_running), ("num_waiting", num_waiting),
            ("num_swapped", num_swapped), ("batch_tokens", batch_tokens))}
        ledger = {str(k): _check_count(f"ledger[{k!r}]", v) for k, v in (ledger or {}).items()}
        if self._samples and set(ledger) != set(self._samples[0].ledger):
            raise ValueError(f"ledger categories {sorted(ledger)} differ from the first sample's "
                             f"{sorted(self._samples[0].ledger)}")
        self._samples.append(TraceSample(float(time_s), ledger=ledger, **counts))

    def to_dict(self) -> dict[str, Any]:
        """Columns: ``time_s``, the counts, and ``ledger`` as ``{category: [bytes per sample]}``."""
        cols = {f.name: [getattr(s, f.name) for s in self._samples]
                for f in dataclasses.fields(TraceSample) if f.name != "ledger"}
        cats = list(self._samples[0].ledger) if self._samples else []
        cols["ledger"] = {c: [s.ledger[c] for s in self._samples] for c in cats}
        return cols


@dataclasses.dataclass
class StepTiming:
    """Seconds spent in each phase of the last engine step (host phases vs waiting on the device)."""

    schedule: float = 0.0
    prepare: float = 0.0  # swap / poison / CoW calls + batch build + dispatch
    device: float = 0.0  # waiting for a step's tokens (with overlap: the part not hidden)
    postprocess: float = 0.0  # reading back: tokens, stops, forks, outputs
    num_seqs: int = 0
    num_tokens: int = 0

    @property
    def host(self) -> float:
        return self.schedule + self.prepare + self.postprocess
