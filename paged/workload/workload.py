"""Workloads for serving studies: arrival processes, length distributions, trace files.

A `Workload` is an immutable list of `RequestSpec` labelled ``evidence="real"`` (a trace of real
traffic), ``"constructed"`` (drawn here from a seed, or a hand-written trace) or ``"simulated"`` (the
output of a simulator); `check_same_evidence` keeps a study from mixing them.

Arrivals (seconds): the first request at 0, then one gap per request (vLLM ``benchmark_serving``).
`poisson_arrivals` draws exponential gaps of mean ``1 / rate``. `gamma_arrivals` draws gamma gaps of
shape ``k = burstiness`` and scale ``1 / (rate * k)``: mean still ``1 / rate``, coefficient of
variation ``1 / sqrt(k)``; ``k = 1`` is Poisson (the same draws for a seed), ``k < 1`` burstier
(vLLM's ``--burstiness``). ``rate = inf`` sends everything at 0 (an offline baseline only).
`fixed_arrivals` checks given times.

Lengths (always "constructed"): lognormal, with the dataset means of the PagedAttention paper (Kwon
et al., SOSP 2023): ShareGPT 161.31 input / 337.99 output tokens, Alpaca 19.31 / 58.45. The paper
gives means and histograms, not a fit, so ``sigma`` is our stated choice (`LengthProfile`): 1.0 for
ShareGPT (long tails), 0.7 for Alpaca; ``mu = log(mean * scale) - sigma**2 / 2`` keeps the mean.
Scale rule, linear: ``scale = max_model_len / 2048`` (2048 = context of the OPT / LLaMA models the
paper served), so lengths keep their ratio to the window. Then round and clip: prompt to
``[1, max_model_len - shared - 1]``, output to ``[1, max_model_len - prompt_len]``, so every request
fits (at 2048 this trims ~1.6% of ShareGPT outputs, lowering their mean ~4%). ``Workload.meta``
records the scale, sigmas, target and realised means.

Prompts are byte-token ids: ``BOS_ID`` (256, as `ByteTokenizer.encode` adds to text), the shared
prefix (a system prompt of ``shared_prefix_len`` tokens plus ``num_shots`` examples of
``shot_len``), then the request's own random bytes. ``prompt_len`` counts all of them; the drawn
length ``L >= 1`` counts BOS plus own tokens, so without a shared prefix ``prompt_len == L``.
``RequestSpec.shared_prefix_len`` = leading tokens identical across requests by construction (BOS +
shared prefix); 0 for traces.

Trace files (JSONL): an optional header ``{"workload": {"name", "evidence", "seed", "meta"}}``, then
one object per request: ``arrival_s``, ``output_len``, one of ``prompt`` (text; length = UTF-8 bytes
+ BOS) / ``prompt_token_ids`` / ``prompt_len``; optional ``request_id``, ``n``,
``shared_prefix_len``. Unknown keys are errors, so a typo cannot fall back to a default. A file with
no header must be given its label by the caller (``evidence=``): a trace never defaults to
``"real"``, so a hand-written or generated file cannot pass for recorded traffic.
`RequestSpec` and the line parsers live in `paged.workload.request_spec` (re-exported here).

Real traces: `load_azure_trace` reads the Azure LLM inference traces 2023 (``"code"``, ``"conv"``;
``experiments/traces/azure-llm-2023/``) as ``evidence="real"``: arrivals relative to the first
request, exact token counts, no prompt content (the source has counts only). Derivations
(`Workload.time_scaled`, `window`, `subsample`, `clip_lengths`, `scale_lengths`, and the
shared-system-prompt assumption of `with_synthetic_prompts`) keep the label and append one entry
each (name and arguments) to ``meta["derived"]``, in order; `Workload.label` prints them
(``evidence: real, derived: [time_scale 0.25, window 18:20:03-18:30:03, lengths clipped to 2048]``)
and `check_same_evidence` refuses to compare workloads whose derivations differ.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from paged.util import validate
from paged.workload import azure_trace
from paged.workload.distributions import (  # noqa: F401  (part of this module's interface)
    ALPACA,
    PROFILES,
    REFERENCE_CONTEXT_LEN,
    SHAREGPT,
    LengthProfile,
    SeedLike,
    _check_positive_rate,
    alpaca_like_lengths,
    constructed_arrivals,
    constructed_lengths,
    fixed_arrivals,
    gamma_arrivals,
    length_scale,
    poisson_arrivals,
    profile_lengths,
    sharegpt_like_lengths,
    synthetic_prompt,
)
from paged.workload.evidence import (  # noqa: F401  (part of this module's interface)
    EVIDENCE,
    check_evidence,
    check_same_evidence,
    derivation_label,
    entry_args,
)
from paged.workload.request_spec import (  # noqa: F401  (part of this module's interface)
    BOS_ID,
    RequestSpec,
    at_arrival,
    byte_token_len,
    parse_header,
    parse_json_line,
    parse_request,
    with_lengths,
)

KINDS = ("sharegpt", "alpaca", "fixed")

# The Azure LLM inference traces 2023, shipped in the repository (README there: fields, licence).
AZURE_TRACE_DIR, AZURE_TRACES, AZURE_ATTRIBUTION = (
    azure_trace.TRACE_DIR, azure_trace.TRACES, azure_trace.ATTRIBUTION)



# --- workloads -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Workload:
    """An immutable, labelled list of requests sorted by arrival.

    Attributes:
      name: short name for reports.
      requests: the requests, arrival times non-decreasing, ids unique.
      evidence: ``"real"``, ``"constructed"`` or ``"simulated"``.
      seed: the seed it was drawn from (None for a trace).
      meta: JSON-ready description (source, scale rule, sigmas, ...); normalised through JSON.
    """

    name: str
    requests: tuple[RequestSpec, ...]
    evidence: str
    seed: int | None
    meta: dict = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self):
        check_evidence(self.evidence)
        if self.seed is not None:
            validate.integer("seed", self.seed, minimum=0)
        requests = tuple(self.requests)
        if not requests:
            raise ValueError(f"workload {self.name!r} has no requests")
        seen = set()
        for i, r in enumerate(requests):
            if not isinstance(r, RequestSpec):
                raise TypeError(f"requests[{i}] is {type(r).__name__}, not RequestSpec")
            if r.request_id in seen:
                raise ValueError(f"duplicate request_id={r.request_id!r}")
            seen.add(r.request_id)
            if i and r.arrival_s < requests[i - 1].arrival_s:
                raise ValueError(f"requests[{i}].arrival_s={r.arrival_s} is before the previous "
                                 f"{requests[i - 1].arrival_s}; sort by arrival")
        object.__setattr__(self, "requests", requests)
        if not isinstance(self.meta, Mapping):
            raise TypeError(f"meta must be a mapping, got {type(self.meta).__name__}")
        object.__setattr__(self, "meta", json.loads(json.dumps(dict(self.meta))))

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Span of arrivals: last arrival minus first arrival."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def arrivals(self) -> np.ndarray:
        """Arrival times, f64[num_requests]."""
        return np.array([r.arrival_s for r in self.requests], dtype=np.float64)

    def summary(self) -> dict[str, Any]:
        """Counts, length statistics (mean and p50/p90/p99/max) and arrival rate."""
        prompt = np.array([r.prompt_len for r in self.requests], dtype=np.float64)
        output = np.array([r.output_len for r in self.requests], dtype=np.float64)
        gaps = np.diff(self.arrivals())
        mean_gap = float(gaps.mean()) if gaps.size else None
        return {
            "name": self.name, "evidence": self.evidence, "seed": self.seed,
            "label": self.label(), "derived": list(self.meta.get("derived", [])),
            "num_requests": len(self), "num_sequences": sum(r.n for r in self.requests),
            "duration_s": self.duration_s, "mean_interarrival_s": mean_gap,
            "arrival_rate": (1.0 / mean_gap) if mean_gap else None,
            "total_prompt_tokens": int(prompt.sum()), "total_output_tokens": int(output.sum()),
            "max_total_len": int((prompt + output).max()),
            **_length_stats("prompt_len", prompt), **_length_stats("output_len", output),
        }

    def check_fits(self, max_model_len: int) -> None:
        """Raises ValueError naming the first request with prompt + output > ``max_model_len``."""
        validate.integer("max_model_len", max_model_len, minimum=2)
        for r in self.requests:
            if r.prompt_len + r.output_len > max_model_len:
                raise ValueError(f"request {r.request_id!r}: prompt_len={r.prompt_len} + "
                                 f"output_len={r.output_len} > max_model_len={max_model_len}")

    def with_synthetic_prompts(self, seed: int, *, system_prompt_len: int = 0) -> Workload:
        """Fills random byte-token prompts into requests that only have a length.

        Arrivals and lengths (and so ``evidence``) are unchanged; ``meta`` records the fill. The
        ids come from ``seed`` alone, so the same seed gives the same prompts.

        Args:
          seed: int >= 0.
          system_prompt_len: 0 (default): every prompt is BOS + its own random tokens. ``S > 0``:
            an ASSUMPTION the source data cannot confirm: every request of the workload starts
            with the same system prompt, BOS + ``S`` tokens (a shorter prompt gets its first
            tokens); recorded as a derivation (``shared_system_prompt``), so the label says so.

        Raises:
          ValueError / TypeError: a bad seed or ``system_prompt_len``.
        """
        rng = np.random.default_rng(validate.integer("seed", seed, minimum=0))
        system = validate.integer("system_prompt_len", system_prompt_len, minimum=0)
        shared = (BOS_ID,) + synthetic_prompt(system, rng=rng)

        def fill(r):
            if r.prompt is not None or r.prompt_token_ids is not None:
                return r
            if not system:
                return dataclasses.replace(r, prompt_token_ids=(BOS_ID,) + synthetic_prompt(
                    r.prompt_len - 1, rng=rng))
            head = shared[:r.prompt_len]
            own = synthetic_prompt(r.prompt_len - len(head), rng=rng)
            return dataclasses.replace(r, prompt_token_ids=head + own,
                                       shared_prefix_len=max(r.shared_prefix_len, len(head)))

        meta = {**self.meta, "synthetic_prompt_content_seed": seed}
        if system:
            meta["derived"] = [*self.meta.get("derived", []),
                               {"name": "shared_system_prompt", "tokens": system, "seed": seed,
                                "assumption": "every request shares one system prompt; the "
                                              "source data has no prompt content"}]
        return dataclasses.replace(self, requests=tuple(map(fill, self.requests)), meta=meta)

    # --- derivations: each keeps ``evidence`` and appends one entry to meta["derived"] --------
    def _derive(self, requests, entry: dict, **meta) -> Workload:
        if not requests:
            raise ValueError(f"{entry['name']} {entry_args(entry)} leaves no requests of "
                             f"workload {self.name!r} ({len(self)} requests over "
                             f"{self.duration_s:.1f} s)")
        new_meta = {**self.meta, **meta, "derived": [*self.meta.get("derived", []), entry]}
        return dataclasses.replace(self, requests=tuple(requests), meta=new_meta)

    def _time_base(self) -> tuple[float, float]:
        """``(offset_s, factor)``: time ``t`` here is ``offset_s + t / factor`` in the source."""
        base = self.meta.get("time_base") or {}
        return float(base.get("offset_s", 0.0)), float(base.get("factor", 1.0))

    def time_scaled(self, factor: float) -> Workload:
        """Arrival times times ``factor`` (< 1: a higher mean rate, the same burstiness: every gap
        shrinks by the same factor).

        Raises:
          ValueError / TypeError: ``factor`` not a finite number > 0.
        """
        factor = validate.real("factor", factor, minimum=0, exclusive=True)
        reqs = [at_arrival(r, r.arrival_s * factor) for r in self.requests]
        offset, f = self._time_base()
        return self._derive(reqs, {"name": "time_scale", "factor": factor},
                            time_base={"offset_s": offset, "factor": f * factor})

    def window(self, start_s: float, end_s: float) -> Workload:
        """The requests arriving in ``[start_s, end_s)``, arrivals shifted so ``start_s`` is 0.

        Raises:
          ValueError / TypeError: not ``0 <= start_s < end_s``, or no request in the window.
        """
        start = validate.real("start_s", start_s, minimum=0)
        end = validate.real("end_s", end_s)
        if not end > start:
            raise ValueError(f"window end_s={end_s!r} must be > start_s={start_s!r}")
        reqs = [at_arrival(r, r.arrival_s - start) for r in self.requests if start <= r.arrival_s < end]
        offset, f = self._time_base()
        entry = {"name": "window", "start_s": start, "end_s": end}
        t0 = self.meta.get("start_timestamp")
        if t0:  # the window in the source's wall clock
            clock = [(datetime.datetime.fromisoformat(t0) + datetime.timedelta(
                seconds=offset + t / f)).strftime("%H:%M:%S") for t in (start, end)]
            entry["clock"] = f"{clock[0]}-{clock[1]}"
        return self._derive(reqs, entry, time_base={"offset_s": offset + start / f, "factor": f})

    def subsample(self, fraction: float, seed: int) -> Workload:
        """``round(fraction * len)`` requests (at least one) drawn without replacement from
        ``seed``, in arrival order, arrivals unchanged (a thinner process of the same shape).

        Raises:
          ValueError / TypeError: ``fraction`` not in ``(0, 1]``, a bad seed.
        """
        fraction = validate.real("fraction", fraction, minimum=0, exclusive=True, maximum=1)
        seed = validate.integer("seed", seed, minimum=0)
        k = max(1, round(fraction * len(self)))
        keep = np.sort(np.random.default_rng(seed).choice(len(self), size=k, replace=False))
        return self._derive([self.requests[i] for i in keep.tolist()],
                            {"name": "subsample", "fraction": fraction, "seed": seed, "kept": k})

    def clip_lengths(self, max_model_len: int) -> Workload:
        """Every request fits ``max_model_len``: one with ``prompt + output > max_model_len``
        shrinks both in proportion (prompt ``floor(p * L / (p + o))``, at least 1 and at most
        ``L - 1``; output what is left, at most its own); the others are unchanged. Prompt ids,
        if any, keep their first tokens.

        Raises:
          ValueError / TypeError: ``max_model_len`` not an int >= 2.
        """
        cap = validate.integer("max_model_len", max_model_len, minimum=2)
        reqs, clipped = [], 0
        for r in self.requests:
            p, o = r.prompt_len, r.output_len
            if p + o > cap:
                clipped += 1
                p = min(cap - 1, max(1, (p * cap) // (p + o)))
                o = min(r.output_len, cap - p)
                r = with_lengths(r, p, o)
            reqs.append(r)
        return self._derive(reqs, {"name": "clip_lengths", "max_model_len": cap,
                                   "num_clipped": clipped})

    def scale_lengths(self, factor: float, max_model_len: int | None = None) -> Workload:
        """Prompt and output lengths times ``factor``, rounded, at least 1 (a model with a short
        context serves the trace's length shape); then, with ``max_model_len``, `clip_lengths`.

        Raises:
          ValueError / TypeError: ``factor`` not a finite number > 0, a bad ``max_model_len``.
        """
        factor = validate.real("factor", factor, minimum=0, exclusive=True)
        reqs = [with_lengths(r, max(1, round(r.prompt_len * factor)),
                              max(1, round(r.output_len * factor))) for r in self.requests]
        out = self._derive(reqs, {"name": "scale_lengths", "factor": factor})
        return out if max_model_len is None else out.clip_lengths(max_model_len)

    def label(self) -> str:
        """``evidence: <label>`` and, if derived, ``derived: [entry, ...]`` in order."""
        derived = self.meta.get("derived") or []
        if not derived:
            return f"evidence: {self.evidence}"
        return f"evidence: {self.evidence}, derived: [{', '.join(map(derivation_label, derived))}]"

    def to_jsonl(self, path: str | pathlib.Path) -> None:
        """Writes a header line and one line per request; `from_jsonl` reads it back equal."""
        header = {"workload": {"name": self.name, "evidence": self.evidence, "seed": self.seed,
                               "meta": self.meta}}
        lines = [json.dumps(header)] + [json.dumps(r.to_json()) for r in self.requests]
        pathlib.Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")

    @classmethod
    def from_jsonl(cls, path: str | pathlib.Path, *, evidence: str | None = None,
                   name: str | None = None) -> Workload:
        """Reads a trace file (format in the module docstring).

        Args:
          path: JSONL file.
          evidence: label (``EVIDENCE``); default the header's. Required for a file without a
            header; must agree with a header.
          name: workload name; default the header's, else the file stem.

        Returns:
          The workload.

        Raises:
          ValueError: a malformed line (the message names its 1-based line number), unsorted
            arrivals, duplicate ids, no label (no header and no ``evidence``), or ``evidence``
            that disagrees with the header.
        """
        path = pathlib.Path(path)
        if evidence is not None:
            check_evidence(evidence)
        header, requests = None, []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            obj = parse_json_line(line, line_no, path)
            if header is None and not requests and "workload" in obj:
                header = parse_header(obj, line_no, path)
                continue
            requests.append(parse_request(obj, line_no, path, default_id=f"line{line_no}"))
        if not requests:
            raise ValueError(f"{path}: no requests")
        if header is None and evidence is None:
            raise ValueError(
                f"{path} does not say what it is: add a header line "
                '{"workload": {"evidence": "real"}} (or "constructed" / "simulated") before the '
                "requests, or pass its label (evidence=..., --config.workload.evidence=...)")
        h = header or {"evidence": evidence, "seed": None, "meta": {"source": str(path)}}
        if evidence is not None and header is not None and evidence != header["evidence"]:
            raise ValueError(f"evidence={evidence!r} but {path} says {header['evidence']!r}")
        try:
            return cls(name=name or h.get("name") or path.stem, requests=tuple(requests),
                       evidence=evidence or h["evidence"], seed=h["seed"], meta=h["meta"])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None


def _length_stats(name: str, x: np.ndarray) -> dict[str, float]:
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {f"mean_{name}": float(x.mean()), f"p50_{name}": float(p50),
            f"p90_{name}": float(p90), f"p99_{name}": float(p99), f"max_{name}": int(x.max())}


# --- real traces -----------------------------------------------------------------------------
def load_azure_trace(service: str, *, path: str | pathlib.Path | None = None) -> Workload:
    """One Azure LLM inference trace 2023 as a real workload.

    Args:
      service: ``"code"`` (8,819 requests) or ``"conv"`` (19,366).
      path: the CSV (default the copy in ``experiments/traces/azure-llm-2023/``).

    Returns:
      A Workload with ``evidence="real"``: one length-only request per row, ids
      ``<service>-<row>``, arrivals in seconds from the first request (the 100 ns timestamps
      exactly), ``prompt_len`` = ContextTokens, ``output_len`` = GeneratedTokens; ``meta`` has
      the source file, its SHA-256, the licence, the attribution, the row count, the first
      timestamp and an empty ``derived``. Prompt ids: `Workload.with_synthetic_prompts`.

    Raises:
      ValueError: an unknown service, a missing file, a malformed row (its line number).
    """
    rows = azure_trace.read(service, path)
    requests = tuple(RequestSpec(request_id=f"{service}-{i}", arrival_s=float(t),
                                 prompt_token_ids=None, prompt=None, prompt_len=p, output_len=o)
                     for i, (t, p, o) in enumerate(zip(rows.arrival_s, rows.prompt_lens,
                                                       rows.output_lens)))
    meta = {"source": f"Azure LLM inference trace 2023, {service} service ({rows.file})",
            "service": service, "file": rows.file,
            "sha256": rows.sha256, "row_count": len(requests),
            "licence": "CC-BY-4.0", "attribution": AZURE_ATTRIBUTION,
            "start_timestamp": rows.start_timestamp,
            "prompt_content": "not in the data (counts only); token ids are synthetic "
                              "(Workload.with_synthetic_prompts)",
            "derived": []}
    return Workload(name=f"azure-{service}", requests=requests, evidence="real", seed=None,
                    meta=meta)


# --- workloads -------------------------------------------------------------------------------
def make_workload(kind: str, num_requests: int, rate: float | None, *, max_model_len: int,
                  seed: int, burstiness: float = 1.0, arrival_times: Sequence[float] | None = None,
                  prompt_len: int | None = None, output_len: int | None = None,
                  shared_prefix_len: int = 0, num_shots: int = 0, shot_len: int = 0,
                  n: int = 1) -> Workload:
    """A constructed workload: arrivals, lengths, byte-token prompts, all from ``seed``.

    Arrivals, lengths and prompt content use independent streams spawned from ``seed``, so changing
    ``rate`` or ``burstiness`` keeps the same requests and only moves them in time.

    Args:
      kind: ``"sharegpt"`` / ``"alpaca"`` (lognormal lengths, module docstring) or ``"fixed"``
        (every request has ``prompt_len`` own tokens, BOS included, and ``output_len``).
      num_requests: >= 1.
      rate: mean requests/s (gamma gaps with shape ``burstiness``); None with ``arrival_times``.
      max_model_len: context window every request must fit.
      seed: int >= 0.
      burstiness: gamma shape; 1 = Poisson.
      arrival_times: fixed arrival times instead of ``rate``.
      prompt_len: own prompt tokens for ``kind="fixed"``.
      output_len: output tokens for ``kind="fixed"``.
      shared_prefix_len: system-prompt tokens shared by every request.
      num_shots: few-shot examples shared by every request, ``shot_len`` tokens each.
      shot_len: tokens per example.
      n: parallel samples per request.

    Returns:
      A Workload with ``evidence="constructed"``.

    Raises:
      ValueError / TypeError: unknown kind, bad counts or rates, lengths that cannot fit.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    seed = validate.integer("seed", seed, minimum=0)
    num_requests = validate.integer("num_requests", num_requests, minimum=1)
    prefix = (validate.integer("shared_prefix_len", shared_prefix_len, minimum=0)
              + validate.integer("num_shots", num_shots, minimum=0) * validate.integer("shot_len", shot_len,
                                                                            minimum=0))
    validate.integer("n", n, minimum=1)
    arr_ss, len_ss, tok_ss = np.random.SeedSequence(seed).spawn(3)
    arrivals = constructed_arrivals(num_requests, rate, burstiness, arrival_times, arr_ss)
    prompts, outputs, len_meta = constructed_lengths(kind, num_requests, max_model_len, prefix, prompt_len,
                                          output_len, len_ss)
    rng = np.random.default_rng(tok_ss)
    shared = (BOS_ID,) + synthetic_prompt(prefix, rng=rng)
    requests = tuple(
        RequestSpec(request_id=f"{kind}-{i}", arrival_s=float(arrivals[i]),
                    prompt_token_ids=shared + synthetic_prompt(int(prompts[i]) - 1, rng=rng),
                    prompt=None, prompt_len=prefix + int(prompts[i]), output_len=int(outputs[i]),
                    n=n, shared_prefix_len=prefix + 1)
        for i in range(num_requests))
    meta = {"source": f"constructed by paged.workload.workload.make_workload(kind={kind!r})",
            "kind": kind, "max_model_len": max_model_len,
            "arrivals": ("fixed" if arrival_times is not None else
                         {"process": "gamma" if burstiness != 1 else "poisson",
                          "rate": rate, "burstiness": burstiness}),
            "shared_prefix_len": shared_prefix_len, "num_shots": num_shots, "shot_len": shot_len,
            "bos_id": BOS_ID, "n": n, **len_meta}
    return Workload(name=f"{kind}-{num_requests}", requests=requests, evidence="constructed",
                    seed=seed, meta=meta)
