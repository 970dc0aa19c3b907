"""The KV-policy leaderboard's one table and one plot, joined from pieces of the grid.

`experiments/kv_policies.py` runs a piece of the method x budget grid per command (each piece
starts with the "full" reference arm); with ``--config.join=(dir, ...)`` it runs nothing and
calls ``join`` here: the pieces' rows (the first piece's "full" row, then every other arm in
order), the engine capacity at the SLO of ``experiments/capacity.py``'s ``kv_policy`` variant
(``--config.join_capacity``, optional), the Pareto fronts (quality against realized bytes:
retrieval, higher better; KL against full KV, lower better), ``table`` (markdown) and ``plot``.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTES = "kv_bytes_decode_mean"


def pareto(rows, metric, higher: bool) -> set:
    """Arms no other arm beats on both ``metric`` and decode KV bytes (lower)."""
    def q(r):
        return r[metric] if higher else -r[metric]

    return {r["arm"] for r in rows
            if not any(q(o) >= q(r) and o[BYTES] <= r[BYTES] and (q(o), o[BYTES]) != (q(r), r[BYTES])
                       for o in rows)}


def load_pieces(dirs) -> tuple[list[dict], list[dict]]:
    """``(rows, pieces)``: the joined rows and each piece's provenance and path."""
    rows, pieces, seen = [], [], set()
    for d in dirs:
        path = Path(d) / "kv_policies.json"
        body = json.loads(path.read_text())
        pieces.append({"path": str(path), "revision": body["provenance"].get("git_commit"),
                       "arms": [r["arm"] for r in body["rows"]], "seconds": body["seconds"]})
        for r in body["rows"]:
            if r["arm"] not in seen:
                seen.add(r["arm"])
                rows.append({**r, "kl_mean": r["fidelity"]["kl_mean"], "piece": str(path)})
    front_r, front_k = pareto(rows, "retrieval", True), pareto(rows, "kl_mean", False)
    for r in rows:
        r["pareto_retrieval"], r["pareto_kl"] = r["arm"] in front_r, r["arm"] in front_k
    return rows, pieces


def engine_capacity(paths) -> list[dict]:
    """Per arm of some capacity.json files (an arm's points from several files pooled, its
    capacity recomputed by `experiments.capacity.capacity`): capacity (req/s) and its point."""
    from experiments.capacity import capacity

    points: dict[str, list] = {}
    for a in (a for p in paths for a in json.loads(Path(p).read_text())["arms"]):
        points.setdefault(a["name"], []).extend(a["points"])
    out = []
    for name, pts in points.items():
        pts = sorted(pts, key=lambda p: p["rate"])
        cap = capacity(pts)
        s = next((p["summary"] for p in pts if p["rate"] == cap), {})
        out.append({"arm": name, "capacity_rps": cap, "output_tok_s": s.get("output_throughput"),
                    "p99_ttft_ms": s.get("p99_ttft_ms"), "p99_tpot_ms": s.get("p99_tpot_ms"),
                    "preemptions": s.get("engine_preemptions"),
                    "rates": [(p["rate"], p["meets_slo"]) for p in pts]})
    return out


def _f(v, spec) -> str:
    return "-" if v is None else format(v, spec)


def table(rows) -> str:
    """The leaderboard as a markdown table."""
    head = ("| arm | retrieval | agreement | KL (mean) | top-1 | ppl | KV MiB / seq (ledger) | "
            "pages freed | fleet req/s (sim) | fleet tok/s | Pareto (retr. / KL) |")
    lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    for r in rows:
        f, fl = r["fidelity"], r.get("fleet") or {}
        lines.append(
            f"| {r['arm']} | {r['retrieval']:.2f} | {r['agreement']:.2f} | {f['kl_mean']:.3f} | "
            f"{f['top1_agreement']:.3f} | {f['perplexity']:.2f} | {r[BYTES] / 2**20:.2f} | "
            f"{r['kv_policy']['pages_freed'] if r['kv_policy'] else 0:,} | "
            f"{_f(fl.get('capacity_rps'), '.2f')} | {_f(fl.get('output_tok_s_at_capacity'), ',.0f')} | "
            f"{'yes' if r['pareto_retrieval'] else ''} / {'yes' if r['pareto_kl'] else ''} |")
    return "\n".join(lines)


def capacity_table(cap) -> str:
    lines = ["| arm | capacity (req/s) | output tok/s at capacity | p99 TTFT / TPOT (ms) | "
             "preemptions | rates tried (met) |", "| --- | --- | --- | --- | --- | --- |"]
    for a in cap:
        tried = ", ".join(f"{r:g}{'' if ok else ' (miss)'}" for r, ok in a["rates"])
        lines.append(f"| {a['arm']} | {_f(a['capacity_rps'], 'g')} | {_f(a['output_tok_s'], '.1f')} "
                     f"| {_f(a['p99_ttft_ms'], '.0f')} / {_f(a['p99_tpot_ms'], '.1f')} | "
                     f"{_f(a['preemptions'], 'd')} | {tried} |")
    return "\n".join(lines)


def plot(rows, path) -> None:
    """Retrieval and KL against realized bytes, a marker per method, the Pareto fronts drawn."""
    from experiments.plots import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    methods = sorted({r["method"] for r in rows})
    marks = dict(zip(methods, "os^vDP*X", strict=False))
    for ax, metric, flag, label, higher in (
            (axes[0], "retrieval", "pareto_retrieval", "retrieval exact match", True),
            (axes[1], "kl_mean", "pareto_kl", "KL(full || policy), mean over the continuation",
             False)):
        for m in methods:
            pts = [r for r in rows if r["method"] == m]
            ax.scatter([r[BYTES] / 2**20 for r in pts], [r[metric] for r in pts],
                       marker=marks[m], s=40, label=m)
        front = sorted((r for r in rows if r[flag]), key=lambda r: r[BYTES])
        ax.step([r[BYTES] / 2**20 for r in front], [r[metric] for r in front],
                where="post", color="black", lw=0.8, ls="--", label="Pareto front")
        for r in front:
            ax.annotate(r["arm"], (r[BYTES] / 2**20, r[metric]), fontsize=6)
        ax.set_xlabel("KV MiB per sequence while decoding (ledger)")
        ax.set_ylabel(label)
        if not higher:
            ax.set_yscale("symlog", linthresh=1e-3)
    axes[0].legend(fontsize=7)
    fig.suptitle("KV policies on SmolLM2-135M: quality against realized bytes")
    save(fig, path)


__all__ = ["capacity_table", "engine_capacity", "load_pieces", "pareto", "plot", "table"]
