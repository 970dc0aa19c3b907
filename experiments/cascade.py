"""Cascade (shared-prefix) decode attention against ordinary paged decode attention: kernel time
and K/V bytes read, as a function of group size and shared prefix length.

Each point is one decode step of one group: ``n`` sequences whose page tables start with the same
``p`` prefix tokens (whole pages), each with ``suffix_tokens`` of its own after it (a partial last
page included), in a shuffled page pool (`pallas_kernels.testing.make_cascade_case`). Both sides
run the same implementation (``impl``, "xla" by default): ordinary
`pallas_kernels.paged_attention` reads every member's whole table;
`pallas_kernels.cascade_paged_attention` reads the prefix once for the group and merges it with
each member's suffix pass. The outputs are compared (``max_abs_diff``) before timing.

Timing is `experiments.kernel_bench_lib.interleaved_rounds` (cascade and ordinary timed back to
back each round, the order alternating) and `per_round_ratios` (the headline ``ratio`` is the
median over rounds of cascade time / ordinary time, with its spread). Bytes are counted by
`pallas_kernels.cascade.kv_bytes_read` (whole pages, one layer).

From the points with ``n >= 2`` the study fits ``t_cascade - t_ordinary = a - b * saved`` (seconds;
``saved = (n - 1) * p`` prefix token reads per KV head not repeated): ``a`` is cascade's fixed
extra cost, ``b`` the time of one saved token read, and ``a / b`` the break-even saving in token
reads, which is what `paged.step.cascade_plan.CascadeCost.overhead_tokens` states. It also lists, per
group size, the smallest measured prefix from which cascade was faster at every longer prefix.

Only CPU can be timed on this machine: the figures are XLA on CPU, not a GPU or TPU.
"""

from __future__ import annotations

import math
import os

import numpy as np

from experiments import common, plots

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max |cascade - ordinary| (outputs are O(1))


def check(c) -> None:
    import pallas_kernels as pk

    common.check_positive(num_q_heads=c.num_q_heads, num_kv_heads=c.num_kv_heads,
                          head_dim=c.head_dim, page_size=c.page_size, repeats=c.repeats,
                          calls=c.calls)  # fmt: skip
    for name in ("suffix_tokens", "warmup"):
        if getattr(c, name) < 0:
            raise ValueError(f"{name}={getattr(c, name)} must be >= 0")
    if c.num_q_heads % c.num_kv_heads:
        raise ValueError(f"num_q_heads={c.num_q_heads} must be a multiple of "
                         f"num_kv_heads={c.num_kv_heads}")
    if c.dtype not in TOLERANCE:
        raise ValueError(f"dtype={c.dtype!r} must be one of {tuple(TOLERANCE)}")
    for name in ("group_sizes", "prefix_tokens"):
        values = getattr(c, name)
        if isinstance(values, (str, bytes)) or not values or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name}={values!r} must be a non-empty tuple of integers >= 1 "
                             f"(e.g. --config.{name}=2,8)")
    for p in c.prefix_tokens:
        if int(p) < c.page_size or int(p) % c.page_size:
            raise ValueError(f"prefix_tokens has {p}: each must be a positive multiple of "
                             f"page_size={c.page_size} (shared prefixes are whole pages)")
    pk.resolve_impl(c.impl)


def point(c, n: int, prefix: int, rng) -> dict:
    """One (group size, prefix) point: outputs compared, then interleaved timing and bytes."""
    import functools

    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from experiments import kernel_bench_lib as kb
    from pallas_kernels import cascade, testing

    page = c.page_size
    pps = -(-(prefix + c.suffix_tokens) // page)
    case = testing.make_cascade_case(
        rng, [(prefix // page, [c.suffix_tokens] * n)], [], num_q_heads=c.num_q_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, page_size=page, pages_per_seq=pps,
        num_groups=1, group_size=n, dtype=c.dtype,
    )  # fmt: skip
    sm_scale = c.head_dim**-0.5
    ordinary_args = tuple(map(jnp.asarray, (case.q, case.k_pages, case.v_pages, case.lengths,
                                            case.page_indices)))  # fmt: skip
    cascade_args = ordinary_args + (jnp.asarray(case.group_rows), jnp.asarray(case.prefix_lens))
    ordinary_fn = jax.jit(functools.partial(pk.paged_attention, sm_scale=sm_scale, impl=c.impl))
    cascade_fn = jax.jit(functools.partial(pk.cascade_paged_attention, sm_scale=sm_scale,
                                           impl=c.impl))  # fmt: skip
    out_c = np.asarray(cascade_fn(*cascade_args), np.float64)
    out_o = np.asarray(ordinary_fn(*ordinary_args), np.float64)
    diff = float(np.max(np.abs(out_c - out_o)))
    times = kb.interleaved_rounds(
        {"cascade": (cascade_fn, cascade_args), "ordinary": (ordinary_fn, ordinary_args)},
        repeats=c.repeats, warmup=c.warmup, calls=c.calls,
    )  # fmt: skip
    itemsize = 2 if c.dtype == "bfloat16" else 4
    members = [int(r) for r in case.group_rows[0]]
    kv_bytes = cascade.kv_bytes_read(case.lengths, [members], [prefix], page_size=page,
                                     bytes_per_token=2 * c.num_kv_heads * c.head_dim * itemsize)
    return {
        "group_size": n, "prefix_tokens": prefix, "suffix_tokens": c.suffix_tokens,
        "saved_token_reads": (n - 1) * prefix,
        "max_abs_diff": diff, "correct": bool(np.isfinite(diff) and diff <= TOLERANCE[c.dtype]),
        "cascade_ms": {k: 1e3 * v if k != "rounds" else v
                       for k, v in kb.spread(times["cascade"]).items()},
        "ordinary_ms": {k: 1e3 * v if k != "rounds" else v
                        for k, v in kb.spread(times["ordinary"]).items()},
        "ratio": kb.per_round_ratios(times["cascade"], times["ordinary"]),
        "kv_bytes": kv_bytes,
        "bytes_ratio": kv_bytes["cascade"] / kv_bytes["ordinary"],
    }  # fmt: skip


def derive_cost(points: list[dict]) -> dict:
    """The break-even fit and the observed crossovers (see the module docstring)."""
    multi = [p for p in points if p["group_size"] >= 2]
    crossovers = {}
    for n in sorted({p["group_size"] for p in points}):
        row = sorted((p for p in points if p["group_size"] == n), key=lambda p: p["prefix_tokens"])
        faster = [p["ratio"]["median"] < 1 for p in row]
        first = next((i for i in range(len(row)) if all(faster[i:])), None)
        crossovers[str(n)] = None if first is None else {
            "prefix_tokens": row[first]["prefix_tokens"],
            "saved_token_reads": row[first]["saved_token_reads"]}
    fit = {"points": len(multi)}
    if len(multi) >= 2:
        saved = np.asarray([p["saved_token_reads"] for p in multi], np.float64)
        diff = np.asarray([(p["cascade_ms"]["median"] - p["ordinary_ms"]["median"]) * 1e-3
                           for p in multi])  # fmt: skip
        design = np.stack([np.ones_like(saved), -saved], axis=1)
        (a, b), *_ = np.linalg.lstsq(design, diff, rcond=None)
        resid = diff - design @ np.asarray([a, b])
        fit.update({"fixed_extra_s": float(a), "seconds_per_saved_token_read": float(b),
                    "rms_residual_s": float(np.sqrt(np.mean(resid**2)))})
        fit["break_even_saved_token_reads"] = float(a / b) if b > 0 and a > 0 else None
    return {"fit": fit, "crossovers": crossovers}


def _load() -> dict:
    return {"loadavg": os.getloadavg(), "cpu_count": os.cpu_count()}


def plot(points: list[dict], path) -> None:
    plt = plots.pyplot()

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in sorted({p["group_size"] for p in points}):
        row = sorted((p for p in points if p["group_size"] == n), key=lambda p: p["prefix_tokens"])
        x = [p["prefix_tokens"] for p in row]
        med = np.asarray([p["ratio"]["median"] for p in row])
        lo = med - np.asarray([p["ratio"]["q1"] for p in row])
        hi = np.asarray([p["ratio"]["q3"] for p in row]) - med
        ax_t.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, label=f"group of {n}")
        ax_b.plot(x, [p["bytes_ratio"] for p in row], marker="o", label=f"group of {n}")
    for ax, title in ((ax_t, "time: cascade / ordinary (median over rounds, IQR)"),
                      (ax_b, "K/V bytes read: cascade / ordinary")):
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shared prefix tokens")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    plots.save(fig, path)


def payload_of(c, points: list[dict], load_before: dict) -> dict:
    """The JSON: config, provenance, load, the points so far and what they imply."""
    derived = derive_cost(points)
    be = derived["fit"].get("break_even_saved_token_reads")
    derived["overhead_tokens"] = None if be is None else int(c.page_size *
                                                             math.ceil(be / c.page_size))
    return {"study": "cascade", "evidence": "measured (random K/V, synthetic groups)",
            "config": c.to_dict(), "provenance": common.provenance(),
            "load": {"before": load_before, "after": _load()}, "points": points,
            "derived": derived, "all_correct": all(p["correct"] for p in points)}


def main(c, _plan) -> None:
    out_dir = common.output_dir(c, "cascade")
    rng = np.random.default_rng(c.seed)
    grid = [(int(n), int(p)) for n in c.group_sizes for p in c.prefix_tokens]
    load_before = _load()
    points = []
    with common.Progress(len(grid), "cascade", unit="points") as bar:
        for n, prefix in grid:
            rec = point(c, n, prefix, rng)
            points.append(rec)
            bar.update()
            print(f"n={n:<3} prefix={prefix:<5} cascade {rec['cascade_ms']['median']:.3f} ms "
                  f"ordinary {rec['ordinary_ms']['median']:.3f} ms ratio "
                  f"{rec['ratio']['median']:.3f} [{rec['ratio']['q1']:.3f}, "
                  f"{rec['ratio']['q3']:.3f}] bytes {rec['bytes_ratio']:.3f} "
                  f"diff {rec['max_abs_diff']:.1e}", flush=True)
            # Rewritten after every point: a run stopped by a time limit keeps what it measured.
            payload = payload_of(c, points, load_before)
            path = common.write_result(out_dir / "cascade.json", payload)
    if c.plot:
        plot(points, out_dir / "cascade.png")
    derived = payload["derived"]
    print(f"fit {derived['fit']}\ncrossovers {derived['crossovers']}\n"
          f"overhead_tokens {derived['overhead_tokens']}\nwrote {path}")
    if not payload["all_correct"]:
        raise SystemExit("cascade output differs from ordinary paged attention (see max_abs_diff)")


if __name__ == "__main__":
    common.run("cascade", main, check)
