"""Reading the Azure LLM inference traces 2023 (the CSVs shipped in
``experiments/traces/azure-llm-2023/``): rows checked and parsed exactly, nothing else.
``paged.workload.workload.load_azure_trace`` turns them into a real ``Workload``."""

from __future__ import annotations

import csv
import datetime
import hashlib
import pathlib
from typing import NamedTuple

import numpy as np

TRACE_DIR = pathlib.Path(__file__).resolve().parents[2] / "experiments/traces/azure-llm-2023"
TRACES = {"code": "AzureLLMInferenceTrace_code.csv", "conv": "AzureLLMInferenceTrace_conv.csv"}
ATTRIBUTION = ("Patel et al., 'Splitwise: Efficient generative LLM inference using phase "
               "splitting', ISCA 2024")
COLUMNS = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]


class TraceRows(NamedTuple):
    """One trace file's rows."""

    path: pathlib.Path
    file: str  # the path relative to the repository (or as given, outside it)
    sha256: str  # of the file's bytes
    start_timestamp: str  # the first row's TIMESTAMP (to the microsecond)
    arrival_s: np.ndarray  # f64[n]: seconds from the first request (exact 100 ns ticks / 1e7)
    prompt_lens: list[int]  # ContextTokens
    output_lens: list[int]  # GeneratedTokens


def read(service: str, path: str | pathlib.Path | None = None) -> TraceRows:
    """The rows of ``service``'s trace (``path``: default the shipped copy).

    Raises:
      ValueError: an unknown service, a missing file, a bad header or a malformed row (its line
        number).
    """
    if service not in TRACES:
        raise ValueError(f"service={service!r} must be one of {tuple(TRACES)}")
    path = pathlib.Path(path) if path is not None else TRACE_DIR / TRACES[service]
    if not path.is_file():
        raise ValueError(f"no trace file {str(path)!r}")
    data = path.read_bytes()
    rows = list(csv.reader(data.decode("utf-8-sig").splitlines()))
    if not rows or rows[0] != COLUMNS:
        raise ValueError(f"{path}:1: header {rows[0] if rows else None!r} must be {COLUMNS}")
    ticks, prompts, outputs = [], [], []
    for line_no, row in enumerate(rows[1:], start=2):
        try:
            if len(row) != 3:
                raise ValueError(f"{len(row)} fields")
            ticks.append(_ticks(row[0]))
            p, o = int(row[1]), int(row[2])
            if p < 1 or o < 1:
                raise ValueError(f"token counts must be >= 1, got {p}, {o}")
            prompts.append(p)
            outputs.append(o)
        except ValueError as e:
            raise ValueError(f"{path}:{line_no}: {row!r}: {e}") from None
    if not prompts:
        raise ValueError(f"{path}: no requests")
    try:
        rel = str(path.resolve().relative_to(TRACE_DIR.parents[2]))
    except ValueError:
        rel = str(path)
    t0 = ticks[0]
    return TraceRows(path, rel, hashlib.sha256(data).hexdigest(), rows[1][0].strip()[:26],
                     np.array([(t - t0) / 1e7 for t in ticks]), prompts, outputs)


def _ticks(stamp: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffff]`` as integer 100 ns ticks since the epoch (exact)."""
    whole, _, frac = stamp.strip().partition(".")
    if len(frac) > 7 or (frac and not frac.isdigit()):
        raise ValueError(f"bad timestamp {stamp!r}")
    t = datetime.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(
        tzinfo=datetime.timezone.utc)
    return int(t.timestamp()) * 10_000_000 + int(frac.ljust(7, "0") or 0)
