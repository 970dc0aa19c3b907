"""The block manager's host cost, this tree against a baseline tree, with nano-vllm beside each.

    python -m experiments.host_speed --config=experiments/configs/host_speed.py \
        --config.nanovllm_path=DIR --config.baseline=OLD_TREE

Each round runs one child process per source tree (this one, and ``baseline`` if set), the order
alternating between rounds. A child replays ``experiments/block_manager_bench.py``'s constructed
trace with that tree's own code, interleaved step by step with nano-vllm's block manager when
``nanovllm_path`` is set (`block_manager_bench.versus_nanovllm`), and reports, per decode-call
style, the medians of our decode step and of the whole step with churn and their ratios to
nano-vllm's (and the means and their ratio, where the tree's bench reports them: work deferred
to an occasional step moves a median, not a mean). Ratios within one child cancel the machine's
load; the spread over rounds shows what is left. Writes ``host_speed.json`` (every round, medians
and min/max per tree, provenance).

The cyclic garbage collector is set the same way for both sides of a child (``gc``, `GC_NOTE`):
by default ("off") it is disabled during each replay, because in the interleaved run a collection
triggered by either side's allocations lands in whichever timed step crosses the threshold (our
mean step was 1.2x its median with it on, within 2 % with it off). ``gc="off,frozen"`` runs one
arm per mode (per tree), alternated like the trees, so the two modes see the same load.
"""

from __future__ import annotations

import os
from pathlib import Path

from experiments import common, tree_ab

ROOT = Path(__file__).resolve().parent.parent
GC_MODES = ("off", "frozen", "on")
GC_NOTE = ("the cyclic collector during each replay, the same for ours and nano-vllm's: 'off' = "
           "the trace collected and frozen, then the collector disabled (no collection can land "
           "in a timed step); 'frozen' = collected and frozen, collector on (the runs before "
           "2026-12-06 15:30 UTC); 'on' = collected, not frozen, collector on. Every replay "
           "starts after an untimed gc.collect(); gc_collections counts the collections that "
           "ran during it, per generation, gc_ms their wall time (gc.callbacks), and "
           "gc_ms_by_side that time by the side whose step (timed calls and the harness's "
           "untimed work between them) was running.")

# Runs in the child, importing the measured tree's own ``paged`` and ``experiments``.
_CHILD = r"""
import gc, json, sys, time
from experiments import block_manager_bench as b
from experiments.configs.block_manager_bench import get_config
arg = json.loads(sys.argv[1])
mode = arg.get("gc", "frozen")
c = get_config(); c.num_requests = arg["num_requests"]; c.nanovllm_path = arg["nanovllm_path"]
trace = b.make_trace(c); gc.collect()
if mode != "on":
    gc.freeze()  # the trace is the harness's data: out of the collector's passes
out = {}
clock = {"t0": 0.0, "side": "harness", "ours": 0.0, "nanovllm": 0.0, "harness": 0.0}

def timed(phase, info):  # wall time inside collections (gc.callbacks), by the side whose step ran
    if phase == "start":
        clock["t0"] = time.perf_counter()
    else:
        clock[clock["side"]] += time.perf_counter() - clock["t0"]

def attribute(cls, side):  # a collection during cls's step() is charged to ``side``
    step = cls.step
    def wrapped(self):
        clock["side"] = side
        try:
            step(self)
        finally:
            clock["side"] = "harness"
    cls.step = wrapped

for cls, side in ((getattr(b, "_Ours", None), "ours"), (getattr(b, "_NanoVllm", None), "nanovllm")):
    if cls is not None:  # (an older tree's bench without them: all charged to the harness)
        attribute(cls, side)

def under_gc(fn):
    # One replay under the collector mode, the same for both sides: a collection before it
    # (untimed), then the collector as ``mode`` says; the collections it ran, per generation,
    # and the milliseconds they took.
    gc.collect()
    before = [s["collections"] for s in gc.get_stats()]
    clock.update(ours=0.0, nanovllm=0.0, harness=0.0)
    gc.callbacks.append(timed)
    if mode == "off":
        gc.disable()
    try:
        r = fn()
        ran = [s["collections"] - n for s, n in zip(gc.get_stats(), before)]
        gc.callbacks.remove(timed)
    finally:
        gc.enable()  # (counted before: the first allocation after it may collect)
    by_side = {k: clock[k] * 1e3 for k in ("ours", "nanovllm", "harness")}
    return r, {"gc_collections": ran, "gc_ms": sum(by_side.values()), "gc_ms_by_side": by_side}

if c.nanovllm_path:
    nano = b.load_nanovllm(c.nanovllm_path)
    for api in arg["apis"]:
        v, ran = under_gc(lambda: b.versus_nanovllm(c, trace, nano, api))
        out[api] = {name: {"ours_p50_us": v[name]["ours_us"]["p50"],
                           "nanovllm_p50_us": v[name]["nanovllm_us"]["p50"],
                           "ratio_of_medians": v[name]["ratio_of_medians"]}
                    for name in ("decode_step", "whole_step_with_churn")}
        for name in ("decode_step", "whole_step_with_churn"):  # trees whose bench has means
            if "ratio_of_means" in v[name]:
                out[api][name].update(ours_mean_us=v[name]["ours_us"]["mean"],
                                      nanovllm_mean_us=v[name]["nanovllm_us"]["mean"],
                                      ratio_of_means=v[name]["ratio_of_means"])
        out[api].update(ran)
else:
    for api in arg["apis"]:
        r, ran = under_gc(lambda: b.replay(c, trace, api))
        out[api] = {"decode_step": {"ours_p50_us": r["decode_step_at_max_running_wall"]["p50_us"]},
                    "whole_step_with_churn": {
                        "ours_p50_us": r["whole_step_with_churn_at_max_running_wall"]["p50_us"]},
                    **ran}
print("RESULT " + json.dumps(out))
"""


def check(c) -> dict:
    common.check_positive(num_requests=c.num_requests, rounds=c.rounds)
    trees = {"this": str(ROOT)}
    if c.baseline:
        base = Path(c.baseline).expanduser().resolve()
        if not (base / "experiments" / "block_manager_bench.py").exists():
            raise ValueError(f"baseline={c.baseline!r} holds no experiments/block_manager_bench.py")
        trees["baseline"] = str(base)
    if c.nanovllm_path and not (Path(c.nanovllm_path).expanduser()
                                / "nanovllm/engine/block_manager.py").exists():
        raise ValueError(f"nanovllm_path={c.nanovllm_path!r} holds no "
                         "nanovllm/engine/block_manager.py")
    if not c.apis:
        raise ValueError("apis=() names no decode-call style")
    modes = gc_modes(c.gc)
    arms = {(name if len(modes) == 1 else f"{name} gc={mode}"): {"tree": name, "gc": mode}
            for name in trees for mode in modes}
    return {"trees": trees, "arms": arms}


def gc_modes(value: str) -> list[str]:
    """The collector modes ``gc`` names (one, or several comma-separated: one arm each)."""
    modes = [m.strip() for m in str(value).split(",")]
    bad = [m for m in modes if m not in GC_MODES]
    if bad or len(set(modes)) != len(modes):
        raise ValueError(f"gc={value!r}: expected one or more (comma-separated, no repeats) of "
                         f"{', '.join(GC_MODES)}")
    return modes


def measure(tree: str, c, gc_mode: str | None = None) -> dict:
    """One child run over ``tree``'s code under collector mode ``gc_mode`` (default: ``c.gc``,
    which must then name one mode); its per-api medians, means where the tree's bench has them,
    ratios, and the collections that ran during each replay (``gc_collections``, per
    generation)."""
    modes = gc_modes(gc_mode) if gc_mode else gc_modes(c.gc)
    if len(modes) != 1:
        raise ValueError(f"gc={c.gc!r} names several modes: pass one as gc_mode")
    return tree_ab.run_child(tree, _CHILD, {"num_requests": c.num_requests, "gc": modes[0],
                                            "nanovllm_path": c.nanovllm_path, "apis": list(c.apis)})


def summarize(rounds: list[dict], trees: dict, apis) -> dict:
    """Median, min and max over rounds of every figure, per tree (or arm) and api."""
    out = {}
    for name in trees:
        out[name] = {}
        for api in apis:
            out[name][api] = {}
            for phase in ("decode_step", "whole_step_with_churn"):
                figs = {}
                for key in rounds[0][name][api][phase]:
                    xs = [r[name][api][phase][key] for r in rounds]
                    figs[key] = common.spread(xs)
                out[name][api][phase] = figs
    return out


def main(c, plan):
    out_dir = common.output_dir(c, "host_speed")
    trees, arms = plan["trees"], plan["arms"]
    names = list(arms)
    load = [os.getloadavg()]
    bar = common.Progress(c.rounds * len(names), "[host_speed]", unit="run")
    rounds = tree_ab.alternate(arms, c.rounds,
                               lambda arm: measure(trees[arm["tree"]], c, arm["gc"]), bar,
                               lambda: load.append(os.getloadavg()))
    bar.close()
    summary = summarize(rounds, arms, c.apis)
    for name in names:
        for api in c.apis:
            for phase, figs in summary[name][api].items():
                text = ", ".join(f"{k} {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]"
                                 for k, v in figs.items())
                print(f"{name:8s} {api:6s} {phase:22s} {text}")
            ran = [(r[name][api]["gc_collections"], {k: round(v, 1) for k, v in
                                                      r[name][api]["gc_ms_by_side"].items()})
                   for r in rounds]
            print(f"{name:8s} {api:6s} collections per generation, ms in them, per round: {ran}")
    out = out_dir / "host_speed.json"
    common.write_result(out, {
        "study": "host_speed", "evidence": "constructed", "config": c.to_dict(),
        "trees": tree_ab.revisions(trees), "gc": gc_modes(c.gc), "arms": arms,
        "gc_note": GC_NOTE,
        "rounds": rounds, "summary": summary, "load_average_1_5_15_min": load,
        "provenance": common.provenance()})
    print(f"wrote {out}")


if __name__ == "__main__":
    common.run("host_speed", main, check)
