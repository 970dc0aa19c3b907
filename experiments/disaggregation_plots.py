"""Plots of `experiments/disaggregation.py`'s JSON (redrawable from it alone).

* ``attainment_<trace>_<G>gpu.png``: per SLO pair, SLO attainment against offered rate per GPU;
  colocated in black, each P:D split in a colour from prefill-heavy to decode-heavy.
* ``goodput_per_gpu.png``: per trace and fleet, goodput per GPU (the highest per-GPU rate tried
  with attainment at the target) against the number of prefill replicas (0 = colocated), a line
  per SLO pair.
"""

from __future__ import annotations

from pathlib import Path

from experiments import plots


def plot(payload: dict, out_dir) -> list[Path]:
    plt = plots.pyplot()
    out_dir = Path(out_dir)
    target = payload["attainment_target"]
    paths = []
    cells = []
    for service, res in payload["results"].items():
        for fleet in res["fleets"]:
            g = fleet["gpus"]
            slos = [row["slo"] for row in fleet["comparison"]]
            fig, axes = plt.subplots(1, len(slos), figsize=(4.6 * len(slos), 3.8), squeeze=False)
            cmap = plt.get_cmap("viridis")
            for ax, slo in zip(axes[0], slos):
                for p in range(g):
                    pts = sorted((q for q in fleet["points"] if q["prefill"] == p),
                                 key=lambda q: q["rate_per_gpu"])
                    xs = [q["rate_per_gpu"] for q in pts]
                    ys = [q["attainment"][slo] for q in pts]
                    if p == 0:
                        ax.plot(xs, ys, color="black", lw=2.2, marker="o", ms=3, label="colocated")
                    else:
                        ax.plot(xs, ys, color=cmap((p - 1) / max(g - 2, 1)), lw=0.9, marker=".",
                                ms=3, label=f"{p}:{g - p}")
                ax.axhline(target, color="grey", ls="--", lw=0.7)
                ax.set_ylim(-0.02, 1.02)
                ax.set_xlabel("offered rate per GPU (req/s)")
                ax.set_ylabel("SLO attainment")
                ax.set_title(f"TTFT/TPOT <= {slo} ms", fontsize=9)
                ax.grid(alpha=0.3)
            axes[0][-1].legend(fontsize=6, ncol=2 if g > 8 else 1)
            fig.suptitle(f"Azure {service}, {g} H200s ({fleet['link']}): colocated vs P:D "
                         f"(evidence simulated over real; {res['label']})", fontsize=8)
            paths.append(plots.save(fig, out_dir / f"attainment_{service}_{g}gpu.png"))
            cells.append((service, fleet))
    fig, axes = plt.subplots(1, len(cells), figsize=(4.6 * len(cells), 3.6), squeeze=False)
    for ax, (service, fleet) in zip(axes[0], cells):
        g = fleet["gpus"]
        for row in fleet["comparison"]:
            gp = row["goodput_per_gpu"]
            xs = list(range(g))
            ys = [gp["colocated"]] + [gp[f"{p}:{g - p}"] for p in range(1, g)]
            ax.plot(xs, [y if y is not None else 0.0 for y in ys], marker="o", ms=3,
                    label=f"{row['slo']} ms")
        ax.set_xticks(range(g))
        ax.set_xticklabels(["colo"] + [f"{p}:{g - p}" for p in range(1, g)], rotation=90,
                           fontsize=6)
        ax.set_ylabel(f"goodput per GPU (req/s, >= {target:.0%} in SLO)")
        ax.set_title(f"{service}, {g} H200s", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("Goodput per GPU (DistServe's form); 0 = none of the rates tried met it "
                 "(evidence simulated over real)", fontsize=8)
    paths.append(plots.save(fig, out_dir / "goodput_per_gpu.png"))
    return paths
