"""PNG plots of serving results: latency CDFs and KV usage by ledger category over time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

LEDGER_ORDER = ("effective_kv", "shared", "tail_fragmentation", "cached_free", "reserved", "free")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display), its chatter silenced."""
    from experiments.common import quiet_matplotlib

    quiet_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, *, dpi: int = 110) -> Path:
    """Lays ``fig`` out tightly, writes it to ``path`` as PNG, closes it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def latency_cdfs(arms, path: Path) -> Path:
    """One panel per metric (TTFT, TPOT, E2E), one line per arm, finished requests only."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (label, attr) in zip(axes, (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E latency", "e2el_s"))):
        for arm in arms:
            vals = np.sort([1e3 * getattr(r, attr) for r in arm.records
                            if r.status == "finished" and getattr(r, attr) is not None])
            if vals.size:
                ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=arm.name)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of finished requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    save(fig, path)
    return path


def kv_usage(arms, path: Path) -> Path:
    """Stacked KV-pool bytes by ledger category over time, one panel per arm."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(arms), figsize=(6.5 * len(arms), 3.8), squeeze=False)
    for ax, arm in zip(axes[0], arms):
        t = np.asarray(arm.trace.get("time_s", []))
        ledger = arm.trace.get("ledger", {})
        cats = [c for c in LEDGER_ORDER if c in ledger]
        if t.size and cats:
            ys = [np.asarray(ledger[c]) / 2**20 for c in cats]
            ax.stackplot(t, ys, labels=cats, step="post")
        ax.set_title(arm.name)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("KV pool (MiB)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(loc="upper right", fontsize=8)
    save(fig, path)
    return path


def capacity_curves(arms, ttft_slo_ms: float, tpot_slo_ms: float, path: Path) -> Path:
    """p99 TTFT and p99 TPOT against the request rate, one line per arm, SLOs dashed."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, slo, label in ((axes[0], "p99_ttft_ms", ttft_slo_ms, "p99 TTFT (ms)"),
                                (axes[1], "p99_tpot_ms", tpot_slo_ms, "p99 TPOT (ms)")):
        for arm in arms:
            pts = [(p["rate"], p["summary"].get(key)) for p in arm["points"]
                   if p["summary"].get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=arm["name"])
        ax.axhline(slo, ls="--", color="gray", label="SLO")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    save(fig, path)
    return path
