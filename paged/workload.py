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
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from paged import validate
from paged.distributions import (  # noqa: F401  (part of this module's interface)
    ALPACA,
    PROFILES,
    REFERENCE_CONTEXT_LEN,
    SHAREGPT,
    LengthProfile,
    SeedLike,
    _check_positive_rate,
    alpaca_like_lengths,
    fixed_arrivals,
    gamma_arrivals,
    length_scale,
    poisson_arrivals,
    profile_lengths,
    sharegpt_like_lengths,
    synthetic_prompt,
)

EVIDENCE = ("real", "constructed", "simulated")
BOS_ID = 256  # ByteTokenizer.bos_id; not imported so this module stays free of JAX.
KINDS = ("sharegpt", "alpaca", "fixed")

_REQUEST_KEYS = frozenset({"request_id", "arrival_s", "prompt", "prompt_token_ids", "prompt_len",
                           "output_len", "n", "shared_prefix_len"})


# --- validation helpers ----------------------------------------------------------------------
def check_evidence(evidence: Any) -> str:
    """Returns ``evidence`` if it is a valid label; raises ValueError otherwise."""
    if evidence not in EVIDENCE:
        raise ValueError(f"evidence={evidence!r} must be one of {EVIDENCE}")
    return evidence


# --- requests and workloads ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
      request_id: unique within the workload.
      arrival_s: arrival time in seconds from the start of the run.
      prompt_token_ids: the prompt as token ids, or None.
      prompt: the prompt as text, or None (at most one of the two is set; neither for a
        length-only trace, see `Workload.with_synthetic_prompts`).
      prompt_len: prompt tokens, BOS included.
      output_len: tokens to generate (``max_tokens`` with EOS ignored).
      n: parallel samples of this prompt.
      shared_prefix_len: leading prompt tokens identical across the workload by construction.
    """

    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...] | None
    prompt: str | None
    prompt_len: int
    output_len: int
    n: int = 1
    shared_prefix_len: int = 0

    def __post_init__(self):
        validate.string("request_id", self.request_id)
        object.__setattr__(self, "arrival_s", validate.real("arrival_s", self.arrival_s, minimum=0))
        validate.integer("prompt_len", self.prompt_len, minimum=1)
        validate.integer("output_len", self.output_len, minimum=1)
        validate.integer("n", self.n, minimum=1)
        validate.integer("shared_prefix_len", self.shared_prefix_len, minimum=0)
        if self.shared_prefix_len > self.prompt_len:
            raise ValueError(f"shared_prefix_len={self.shared_prefix_len} > "
                             f"prompt_len={self.prompt_len}")
        if self.prompt is not None and self.prompt_token_ids is not None:
            raise ValueError(f"request {self.request_id!r}: both prompt and prompt_token_ids")
        if self.prompt is not None:
            self._check_text()
        if self.prompt_token_ids is not None:
            self._check_ids()

    def _check_text(self):
        if not isinstance(self.prompt, str) or not self.prompt:
            raise TypeError(f"prompt={self.prompt!r:.80} must be a non-empty str")
        if byte_token_len(self.prompt) != self.prompt_len:
            raise ValueError(f"request {self.request_id!r}: prompt_len={self.prompt_len} but the "
                             f"prompt is {byte_token_len(self.prompt)} byte tokens (BOS included)")

    def _check_ids(self):
        ids = tuple(validate.token_ids("prompt_token_ids", self.prompt_token_ids))
        if len(ids) != self.prompt_len:
            raise ValueError(f"request {self.request_id!r}: prompt_len={self.prompt_len} but "
                             f"{len(ids)} prompt_token_ids")
        object.__setattr__(self, "prompt_token_ids", ids)

    def engine_prompt(self) -> str | list[int]:
        """The prompt as `Engine.add_request` takes it (text, or a list of token ids).

        Raises:
          ValueError: the request only has a length (call `Workload.with_synthetic_prompts`).
        """
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        if self.prompt is not None:
            return self.prompt
        raise ValueError(f"request {self.request_id!r} has only prompt_len={self.prompt_len}; "
                         "call Workload.with_synthetic_prompts(seed) first")

    def to_json(self) -> dict[str, Any]:
        """The request as one JSONL object (None fields left out)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        return out


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

    def with_synthetic_prompts(self, seed: int) -> Workload:
        """Fills random byte-token prompts into requests that only have a length.

        Arrivals and lengths (and so ``evidence``) are unchanged; ``meta`` records the fill.
        """
        rng = np.random.default_rng(validate.integer("seed", seed, minimum=0))
        reqs = tuple(r if r.prompt is not None or r.prompt_token_ids is not None else
                     dataclasses.replace(r, prompt_token_ids=(BOS_ID,) + synthetic_prompt(
                         r.prompt_len - 1, rng=rng)) for r in self.requests)
        meta = {**self.meta, "synthetic_prompt_content_seed": seed}
        return dataclasses.replace(self, requests=reqs, meta=meta)

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
            obj = _parse_json_line(line, line_no, path)
            if header is None and not requests and "workload" in obj:
                header = _parse_header(obj, line_no, path)
                continue
            requests.append(_parse_request(obj, line_no, path, default_id=f"line{line_no}"))
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


def byte_token_len(text: str) -> int:
    """Tokens of ``text`` under the bundled byte tokenizer: UTF-8 bytes plus BOS."""
    return len(text.encode("utf-8")) + 1


def check_same_evidence(workloads: Iterable[Any]) -> str:
    """Returns the one evidence label of ``workloads`` (Workloads, or dicts with ``"evidence"``).

    Raises:
      ValueError: no workloads, a missing or invalid label, or mixed labels.
    """
    labels = {}
    for i, w in enumerate(workloads):
        label = w.get("evidence") if isinstance(w, Mapping) else getattr(w, "evidence", None)
        name = w.get("name", i) if isinstance(w, Mapping) else getattr(w, "name", i)
        labels.setdefault(check_evidence(label), []).append(name)
    if not labels:
        raise ValueError("no workloads to check")
    if len(labels) > 1:
        raise ValueError(f"a study must not mix evidence labels: {labels}")
    return next(iter(labels))


# --- JSONL parsing ---------------------------------------------------------------------------
def _parse_json_line(line: str, line_no: int, path: pathlib.Path) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _parse_header(obj: dict, line_no: int, path: pathlib.Path) -> dict:
    h = obj["workload"]
    if len(obj) != 1 or not isinstance(h, dict) or set(h) - {"name", "evidence", "seed", "meta"}:
        raise ValueError(f"{path}:{line_no}: bad header {obj!r:.200}")
    try:
        check_evidence(h.get("evidence"))
    except ValueError as e:
        raise ValueError(f"{path}:{line_no}: {e}") from None
    return {"name": h.get("name"), "evidence": h["evidence"], "seed": h.get("seed"),
            "meta": h.get("meta") or {}}


def _parse_request(obj: dict, line_no: int, path: pathlib.Path, *, default_id: str) -> RequestSpec:
    where = f"{path}:{line_no}"
    unknown = set(obj) - _REQUEST_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(_REQUEST_KEYS)}")
    for key in ("arrival_s", "output_len"):
        if key not in obj:
            raise ValueError(f"{where}: missing {key!r}")
    prompt, ids = obj.get("prompt"), obj.get("prompt_token_ids")
    prompt_len = obj.get("prompt_len")
    if prompt_len is None:
        if prompt is None and ids is None:
            raise ValueError(f"{where}: need one of 'prompt', 'prompt_token_ids', 'prompt_len'")
        # A wrong type gets a placeholder length so RequestSpec names the type error instead.
        prompt_len = byte_token_len(prompt) if isinstance(prompt, str) else (
            len(ids) if isinstance(ids, list) else 1)
    try:
        return RequestSpec(request_id=obj.get("request_id", default_id),
                           arrival_s=obj["arrival_s"], prompt_token_ids=ids, prompt=prompt,
                           prompt_len=prompt_len, output_len=obj["output_len"],
                           n=obj.get("n", 1), shared_prefix_len=obj.get("shared_prefix_len", 0))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


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
    arrivals = _arrivals(num_requests, rate, burstiness, arrival_times, arr_ss)
    prompts, outputs, len_meta = _lengths(kind, num_requests, max_model_len, prefix, prompt_len,
                                          output_len, len_ss)
    rng = np.random.default_rng(tok_ss)
    shared = (BOS_ID,) + synthetic_prompt(prefix, rng=rng)
    requests = tuple(
        RequestSpec(request_id=f"{kind}-{i}", arrival_s=float(arrivals[i]),
                    prompt_token_ids=shared + synthetic_prompt(int(prompts[i]) - 1, rng=rng),
                    prompt=None, prompt_len=prefix + int(prompts[i]), output_len=int(outputs[i]),
                    n=n, shared_prefix_len=prefix + 1)
        for i in range(num_requests))
    meta = {"source": f"constructed by paged.workload.make_workload(kind={kind!r})",
            "kind": kind, "max_model_len": max_model_len,
            "arrivals": ("fixed" if arrival_times is not None else
                         {"process": "gamma" if burstiness != 1 else "poisson",
                          "rate": rate, "burstiness": burstiness}),
            "shared_prefix_len": shared_prefix_len, "num_shots": num_shots, "shot_len": shot_len,
            "bos_id": BOS_ID, "n": n, **len_meta}
    return Workload(name=f"{kind}-{num_requests}", requests=requests, evidence="constructed",
                    seed=seed, meta=meta)


def _arrivals(num, rate, burstiness, arrival_times, ss) -> np.ndarray:
    if arrival_times is not None:
        if rate is not None:
            raise ValueError(f"give rate or arrival_times, not both (rate={rate!r})")
        t = fixed_arrivals(arrival_times)
        if t.size != num:
            raise ValueError(f"{t.size} arrival_times for num_requests={num}")
        return t
    if rate is None:
        raise ValueError("rate=None needs arrival_times")
    return gamma_arrivals(rate, num, burstiness=burstiness, seed=ss)


def _lengths(kind, num, max_model_len, prefix, prompt_len, output_len, ss):
    if kind == "fixed":
        p = validate.integer("prompt_len", prompt_len, minimum=1)
        o = validate.integer("output_len", output_len, minimum=1)
        max_model_len = validate.integer("max_model_len", max_model_len, minimum=2)
        if prefix + p + o > max_model_len:
            raise ValueError(f"shared prefix {prefix} + prompt_len={p} + output_len={o} > "
                             f"max_model_len={max_model_len}")
        return np.full(num, p), np.full(num, o), {"lengths": "fixed"}
    if prompt_len is not None or output_len is not None:
        raise ValueError(f"prompt_len={prompt_len!r}, output_len={output_len!r}: only kind='fixed'")
    profile = PROFILES[kind]
    prompts, outputs = profile_lengths(profile, num, max_model_len=max_model_len, seed=ss,
                                       reserved=prefix)
    meta = {"lengths": {**dataclasses.asdict(profile), "distribution": "lognormal, rounded",
                        "scale_rule": f"linear: max_model_len / {REFERENCE_CONTEXT_LEN}",
                        "scale": length_scale(max_model_len),
                        "clip": "prompt to [1, max_model_len - prefix - 1], "
                                "output to [1, max_model_len - prompt_len]",
                        "realised_mean_prompt": float(prompts.mean()),
                        "realised_mean_output": float(outputs.mean())}}
    return prompts, outputs, meta
