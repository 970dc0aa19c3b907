"""The Mooncake traces (FAST 2025; ``experiments/traces/mooncake-fast25/``) as real workloads.

Each row gives an arrival, the prompt and output lengths and the prompt as a chain of 512-token
block ids (equal ids: equal content). The data has no token ids, so ``load_mooncake_trace``
constructs them from the block ids, a step it records as a derivation (``tokens_from_block_ids``):

* block id ``h`` always gives the same 512 tokens: the first three are the base-``vocab`` digits
  of ``h`` (least significant first), so two different ids differ in their first tokens; the
  other 509 are a SplitMix64 mix of ``(h, position)`` modulo ``vocab``;
* a prompt is the concatenation of its blocks' tokens cut to ``input_length`` (the last block may
  be partial: ``512 * (n - 1) < input_length <= 512 * n`` is checked for every row).

So two prompts share a token prefix exactly as long as their block chains agree (to the shorter
length), and a prefix cache hits exactly where the trace says content repeats.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import NamedTuple

import numpy as np

from paged.workload.request_spec import RequestSpec
from paged.workload.workload import Workload

TRACE_DIR = pathlib.Path(__file__).resolve().parents[2] / "experiments/traces/mooncake-fast25"
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
BLOCK_TOKENS = 512
ATTRIBUTION = ("Qin et al., 'Mooncake: Trading More Storage for Less Computation - A "
               "KVCache-centric Architecture for Serving LLM Chatbot', USENIX FAST 2025")
SOURCE = "kvcache-ai/Mooncake FAST25-release/traces @ 3b5a594133958449a1feaf1c9e0fc1b553e34a28"


class MooncakeRows(NamedTuple):
    """One trace file's rows, checked."""

    file: str
    sha256: str
    arrival_s: list[float]  # timestamp / 1000
    input_lens: list[int]
    output_lens: list[int]
    hash_ids: list[list[int]]


def read(name: str, path: str | pathlib.Path | None = None) -> MooncakeRows:
    """The rows of trace ``name`` (``path``: default the shipped copy).

    Raises:
      ValueError: an unknown name, a missing file, a malformed row (its line number).
    """
    if name not in TRACES:
        raise ValueError(f"name={name!r} must be one of {tuple(TRACES)}")
    path = pathlib.Path(path) if path is not None else TRACE_DIR / TRACES[name]
    if not path.is_file():
        raise ValueError(f"no trace file {str(path)!r}")
    data = path.read_bytes()
    t, p, o, h = [], [], [], []
    for line_no, line in enumerate(data.decode().splitlines(), start=1):
        try:
            row = json.loads(line)
            ids, n_in, n_out = row["hash_ids"], row["input_length"], row["output_length"]
            if set(row) != {"timestamp", "input_length", "output_length", "hash_ids"}:
                raise ValueError(f"fields {sorted(row)}")
            if not all(type(v) is int for v in (n_in, n_out, row["timestamp"])) or n_in < 1 \
                    or n_out < 1 or not ids or any(type(x) is not int or x < 0 for x in ids):
                raise ValueError("lengths, timestamp and ids must be ints (lengths >= 1)")
            if not BLOCK_TOKENS * (len(ids) - 1) < n_in <= BLOCK_TOKENS * len(ids):
                raise ValueError(f"input_length={n_in} does not fit {len(ids)} blocks of "
                                 f"{BLOCK_TOKENS}")
            if t and row["timestamp"] / 1000 < t[-1]:
                raise ValueError("timestamps must not decrease")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line_no}: {e}") from None
        t.append(row["timestamp"] / 1000)
        p.append(n_in)
        o.append(n_out)
        h.append(ids)
    if not p:
        raise ValueError(f"{path}: no requests")
    try:
        rel = str(path.resolve().relative_to(TRACE_DIR.parents[1]))
    except ValueError:
        rel = str(path)
    return MooncakeRows(rel, hashlib.sha256(data).hexdigest(), t, p, o, h)


def block_reuse(hash_ids: list[list[int]]) -> float:
    """Fraction of all prompt blocks whose id appeared in an earlier request (the hit ratio of
    an infinite cache of 512-token blocks; README-source.md's "blocks seen before")."""
    seen: set[int] = set()
    hits = total = 0
    for ids in hash_ids:
        hits += sum(1 for x in ids if x in seen)
        total += len(ids)
        seen.update(ids)
    return hits / total


def block_tokens(hash_ids, length: int, vocab: int, block: int = BLOCK_TOKENS) -> np.ndarray:
    """The first ``length`` tokens of the chain ``hash_ids`` (module docstring; ``block`` tokens
    per id, 512 as in the trace), i64[length]."""
    ids = np.repeat(np.asarray(hash_ids, dtype=np.uint64), block)[:length]
    pos = np.tile(np.arange(block, dtype=np.uint64), len(hash_ids))[:length]
    with np.errstate(over="ignore"):  # SplitMix64: wrapping uint64 arithmetic
        x = ids * np.uint64(0x9E3779B97F4A7C15) + pos * np.uint64(0xD1B54A32D192ED03) \
            + np.uint64(0x632BE59BD9B4E019)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    out = (x % np.uint64(vocab)).astype(np.int64)
    v = np.uint64(vocab)
    for digit in range(3):  # the id's base-vocab digits open every block
        at = pos == digit
        out[at] = ((ids[at] // v ** np.uint64(digit)) % v).astype(np.int64)
    return out


def load_mooncake_trace(name: str, *, window: tuple[float, float] | None = None,
                        vocab: int = 256, path: str | pathlib.Path | None = None,
                        block: int = BLOCK_TOKENS) -> Workload:
    """One Mooncake trace as a real workload with token ids built from its block ids.

    Args:
      name: ``"conversation"`` (12,031 requests over about an hour) or ``"synthetic"`` (3,993).
      window: ``(start_s, end_s)``: only the requests arriving then (`Workload.window`, applied
        before token ids are built, so a short window is cheap); None: all.
      vocab: token ids are in ``[0, vocab)``; ``vocab ** 3`` must exceed every block id.
      path: the JSONL file (default the shipped copy).
      block: tokens per trace block (default 512, the trace's). A smaller one shrinks every
        prompt for a small engine with ``block_size=block``: each id gives ``block`` tokens,
        input and output lengths are scaled by ``block / 512`` (rounded up; the prompt kept in
        its chain's last block), so a block of the engine is a block of the trace and the hits
        are the trace's. Recorded in the derivation.

    Returns:
      A Workload, ``evidence="real"``, ids ``<name>-<row>``, arrivals in seconds, ``meta`` with
      the source, SHA-256, licence, attribution, the infinite-cache block reuse of the whole
      file and ``derived`` ending with ``tokens_from_block_ids``.

    Raises:
      ValueError: a bad name, file, row, window, vocab or block.
    """
    if type(block) is not int or not 4 <= block <= BLOCK_TOKENS:
        raise ValueError(f"block={block!r} must be an int in [4, {BLOCK_TOKENS}]")
    rows = read(name, path)
    if type(vocab) is not int or vocab < 2 or vocab ** 3 <= max(max(ids) for ids in rows.hash_ids):
        raise ValueError(f"vocab={vocab!r}: vocab ** 3 must exceed the largest block id")
    requests = tuple(RequestSpec(request_id=f"{name}-{i}", arrival_s=t, prompt_token_ids=None,
                                 prompt=None, prompt_len=p, output_len=o)
                     for i, (t, p, o) in enumerate(zip(rows.arrival_s, rows.input_lens,
                                                       rows.output_lens)))
    meta = {"source": f"Mooncake {name} trace ({rows.file}); {SOURCE}", "trace": name,
            "file": rows.file, "sha256": rows.sha256, "row_count": len(requests),
            "licence": "Apache-2.0", "attribution": ATTRIBUTION,
            "infinite_cache_block_reuse": block_reuse(rows.hash_ids), "derived": []}
    w = Workload(name=f"mooncake-{name}", requests=requests, evidence="real", seed=None,
                 meta=meta)
    if window is not None:
        w = w.window(*window)
    chains = [rows.hash_ids[int(r.request_id.rsplit("-", 1)[1])] for r in w.requests]

    def fill(r, ids):
        n = r.prompt_len
        if block != BLOCK_TOKENS:  # scaled, and kept in the chain's last block
            n = min(max(-(-n * block // BLOCK_TOKENS), block * (len(ids) - 1) + 1),
                    block * len(ids))
            r = dataclasses.replace(r, prompt_len=n,
                                    output_len=max(1, -(-r.output_len * block // BLOCK_TOKENS)))
        return dataclasses.replace(r, prompt_token_ids=tuple(
            block_tokens(ids, n, vocab, block).tolist()))

    filled = tuple(fill(r, ids) for r, ids in zip(w.requests, chains))
    entry = {"name": "tokens_from_block_ids", "block_tokens": block, "vocab": vocab,
             "rule": f"block id h -> {block} tokens: base-vocab digits of h, then "
                     "SplitMix64(h, pos) % vocab; prompt = blocks cut to input_length"
                     + ("" if block == BLOCK_TOKENS else
                        f" x {block}/512 (rounded up, within the last block); output_length "
                        f"x {block}/512 (rounded up)")}
    meta = {**w.meta, "derived": [*w.meta.get("derived", []), entry]}
    return dataclasses.replace(w, requests=filled, meta=meta)
