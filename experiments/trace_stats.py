"""Characterise the Azure LLM inference traces 2023 (``evidence: real``) beside the Splitwise paper.

Per trace (``paged.workload.workload.load_azure_trace``): request count, arrival span, mean rate (requests
over the span), requests per ``rate_bin_s`` bin, the inter-arrival coefficient of variation (std /
mean of the gaps; 1 for Poisson), and mean, p50, p90, p99 and max of context and generated tokens
(``np.percentile``, linear interpolation). The paper's medians (``configs/trace_stats.PAPER``) sit
beside ours with the difference; one beyond the paper's rounding is printed as ``DIFFERS`` and
recorded (``within_rounding: false``): a defect to explain, not to hide.

Writes ``trace_stats.json`` (statistics, per-bin counts, each trace's label and source metadata,
provenance with the load average) and, with ``plots``, ``rate_per_minute.png`` and
``lengths.png`` (histograms on log-spaced bins, log axes).
"""

from __future__ import annotations

import os

import numpy as np

from experiments import common, plots
from experiments.configs.trace_stats import PAPER
from paged.workload.workload import AZURE_TRACES, Workload, load_azure_trace


def check(c) -> dict:
    bad = [s for s in c.services if s not in AZURE_TRACES]
    if bad or not c.services:
        raise ValueError(f"services={tuple(c.services)}: unknown {bad}; known: "
                         f"{tuple(AZURE_TRACES)}")
    common.check_positive(rate_bin_s=c.rate_bin_s)
    window = tuple(c.window)
    if window and len(window) != 2:
        raise ValueError(f"window={window!r} must be () or (start_s, end_s)")
    traces = {}
    for s in c.services:
        w = load_azure_trace(s)
        if window:
            try:
                w = w.window(*window)
            except (ValueError, TypeError) as e:
                raise ValueError(f"window={window!r}: {e}") from None
        traces[s] = w
    return {"traces": traces}


def stats(w: Workload, rate_bin_s: float) -> dict:
    """The characterisation of one trace (module docstring)."""
    t = w.arrivals()
    gaps = np.diff(t)
    span = float(t[-1] - t[0])
    edges = np.arange(0.0, t[-1] + rate_bin_s, rate_bin_s)
    counts, _ = np.histogram(t, bins=edges)
    out = {"label": w.label(), "num_requests": len(w), "duration_s": span,
           "mean_rate_rps": len(w) / span if span > 0 else None,
           "interarrival_cv": float(gaps.std() / gaps.mean()) if gaps.size and gaps.mean() else None,
           "rate_bin_s": rate_bin_s, "requests_per_bin": counts.tolist(),
           "peak_bin_rate_rps": float(counts.max() / rate_bin_s),
           "empty_bins": int((counts == 0).sum())}
    for key, x in (("context_tokens", [r.prompt_len for r in w.requests]),
                   ("generated_tokens", [r.output_len for r in w.requests])):
        x = np.asarray(x, dtype=np.float64)
        p50, p90, p99 = np.percentile(x, [50, 90, 99])
        out.update({f"mean_{key}": float(x.mean()), f"p50_{key}": float(p50),
                    f"p90_{key}": float(p90), f"p99_{key}": float(p99),
                    f"max_{key}": int(x.max()), f"total_{key}": int(x.sum())})
    return out


def against_paper(service: str, s: dict) -> list[dict]:
    rows = []
    for key in ("p50_context_tokens", "p50_generated_tokens"):
        paper, tol = PAPER[service][key], PAPER[service][f"{key}_tolerance"]
        rows.append({"figure": key, "paper": paper, "paper_rounding": tol, "measured": s[key],
                     "difference": s[key] - paper, "within_rounding": abs(s[key] - paper) <= tol})
    return rows


def main(c, plan):
    out_dir = common.output_dir(c, "trace_stats")
    results = {}
    for service, w in plan["traces"].items():
        s = stats(w, c.rate_bin_s)
        s["paper"] = against_paper(service, s)
        s["meta"] = w.meta
        results[service] = s
        print(f"{service}: {s['label']}")
        print(f"  {s['num_requests']} requests over {s['duration_s']:.1f} s: mean "
              f"{_f(s['mean_rate_rps'], '.3f')} req/s, peak {s['peak_bin_rate_rps']:.2f} req/s "
              f"per {c.rate_bin_s:g} s bin, {s['empty_bins']} empty bins, inter-arrival CV "
              f"{_f(s['interarrival_cv'], '.2f')}")
        for key in ("context_tokens", "generated_tokens"):
            print(f"  {key:17s} mean {s[f'mean_{key}']:8.1f}  p50 {s[f'p50_{key}']:7.1f}  p90 "
                  f"{s[f'p90_{key}']:7.1f}  p99 {s[f'p99_{key}']:7.1f}  max {s[f'max_{key}']}")
        for row in s["paper"]:
            print(f"  paper {row['figure']:22s} {row['paper']:6g} (+-{row['paper_rounding']:g})  "
                  f"measured {row['measured']:7.1f}  "
                  f"{'within rounding' if row['within_rounding'] else 'DIFFERS'}")
    prov = common.provenance()
    prov["load_average"] = list(os.getloadavg())
    path = common.write_result(out_dir / "trace_stats.json", {
        "study": "trace_stats", "evidence": "real", "traces": results,
        "paper": {"source": "Patel et al., 'Splitwise: Efficient generative LLM inference using "
                            "phase splitting', ISCA 2024 (medians as quoted in issue 26)",
                  "figures": PAPER},
        "config": c.to_dict(), "provenance": prov})
    if c.plots:
        plot_rates(results, out_dir / "rate_per_minute.png")
        plot_lengths(plan["traces"], out_dir / "lengths.png")
    print(f"wrote {path}" + (" and plots" if c.plots else ""))


def plot_rates(results: dict, path):
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for service, s in results.items():
        counts = np.asarray(s["requests_per_bin"])
        t = np.arange(counts.size) * s["rate_bin_s"] / 60.0
        ax.step(t, counts / s["rate_bin_s"], where="post",
                label=f"{service} (mean {s['mean_rate_rps']:.2f} req/s, CV {s['interarrival_cv']:.2f})")
    ax.set_xlabel("minutes from the first request")
    ax.set_ylabel(f"requests/s per {results[next(iter(results))]['rate_bin_s']:g} s bin")
    ax.set_title("Azure LLM inference trace 2023: arrival rate (evidence: real)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plots.save(fig, path)


def plot_lengths(traces: dict, path):
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (what, attr) in zip(axes, (("context tokens", "prompt_len"),
                                       ("generated tokens", "output_len"))):
        hi = max(max(getattr(r, attr) for r in w.requests) for w in traces.values())
        bins = np.logspace(0, np.log10(hi + 1), 50)
        for service, w in traces.items():
            x = [getattr(r, attr) for r in w.requests]
            ax.hist(x, bins=bins, histtype="step", label=f"{service} (p50 {np.median(x):g})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(what)
        ax.set_ylabel("requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Azure LLM inference trace 2023: lengths (evidence: real)")
    plots.save(fig, path)


def _f(v, spec):
    return "-" if v is None else format(v, spec)


if __name__ == "__main__":
    common.run("trace_stats", main, check)
