"""Evidence labels and derivations: what kind of input a result stands on, and the check that keeps
one comparison from mixing kinds.

A workload (`paged.workload.workload.Workload`) is labelled ``"real"`` (a trace of real traffic),
``"constructed"`` (drawn from a seed, or written by hand) or ``"simulated"`` (a simulator's output);
a real trace a study transformed (time scaled, windowed, subsampled, lengths clipped) keeps its
label and lists each transformation, in order, in ``meta["derived"]``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

EVIDENCE = ("real", "constructed", "simulated")


def check_evidence(evidence: Any) -> str:
    """Returns ``evidence`` if it is a valid label; raises ValueError otherwise."""
    if evidence not in EVIDENCE:
        raise ValueError(f"evidence={evidence!r} must be one of {EVIDENCE}")
    return evidence


def check_same_evidence(workloads: Iterable[Any], *, swept: Sequence[str] = ()) -> str:
    """Returns the one evidence label of ``workloads`` (Workloads, or dicts with ``"evidence"``
    and optionally ``"derived"`` or ``"meta": {"derived": ...}``).

    Args:
      workloads: the workloads (or their summaries) one comparison puts side by side.
      swept: derivation names whose arguments may differ (the variable a sweep moves, e.g.
        ``("time_scale",)`` in a capacity search); their place in the order must still agree.

    Raises:
      ValueError (one line): no workloads, a missing or invalid label, mixed labels (real with
        constructed, ...), or different derivations (a real trace next to a window of it, two
        different windows, ...).
    """
    labels, derivations = {}, {}
    for i, w in enumerate(workloads):
        if isinstance(w, Mapping):
            label, name = w.get("evidence"), w.get("name", i)
            derived = w.get("derived", (w.get("meta") or {}).get("derived", []))
        else:
            label, name = getattr(w, "evidence", None), getattr(w, "name", i)
            derived = (getattr(w, "meta", None) or {}).get("derived", [])
        labels.setdefault(check_evidence(label), []).append(name)
        key = json.dumps([{"name": d.get("name")} if d.get("name") in swept else d
                          for d in derived or []], sort_keys=True)
        derivations.setdefault(key, []).append(name)
    if not labels:
        raise ValueError("no workloads to check")
    if len(labels) > 1:
        raise ValueError(f"a study must not mix evidence labels: {labels}")
    if len(derivations) > 1:
        shown = {", ".join(derivation_label(d) for d in json.loads(k)) or "none": v
                 for k, v in derivations.items()}
        raise ValueError(f"a study must not compare workloads of different derivations: {shown}")
    return next(iter(labels))


def derivation_label(entry: Mapping) -> str:
    """One ``meta["derived"]`` entry as the label prints it, e.g. ``time_scale 0.25``."""
    name = entry.get("name")
    if name == "time_scale":
        return f"time_scale {entry.get('factor', '?'):g}" if "factor" in entry else "time_scale"
    if name == "window":
        return f"window {entry.get('clock') or _span(entry)}"
    if name == "clip_lengths":
        return f"lengths clipped to {entry.get('max_model_len')}"
    if name == "scale_lengths":
        return f"lengths x{entry.get('factor', '?'):g}" if "factor" in entry else "lengths scaled"
    if name == "subsample":
        return f"subsample {entry.get('fraction', '?'):g} seed {entry.get('seed')}" \
            if "fraction" in entry else "subsample"
    if name == "tokens_from_block_ids":
        return f"token ids built from {entry.get('block_tokens')}-token block ids"
    if name == "shared_system_prompt":
        return f"shared system prompt {entry.get('tokens')} tokens (assumption)"
    return f"{name} {entry_args(entry)}".strip()


def _span(entry: Mapping) -> str:
    return f"{entry.get('start_s', 0):g}-{entry.get('end_s', 0):g} s"


def entry_args(entry: Mapping) -> str:
    """A derivation entry's arguments as ``key=value`` words (its name left out)."""
    return " ".join(f"{k}={v}" for k, v in entry.items() if k != "name")
