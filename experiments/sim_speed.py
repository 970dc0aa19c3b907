"""The simulator's speed, this tree against a baseline tree: CPU seconds per simulated request.

    python -m experiments.sim_speed --config=experiments/configs/sim_speed.py --config.baseline=OLD_TREE

Each round runs one child process per source tree (this one, and ``baseline`` if set), the order
alternating between rounds. A child runs the fleet speed study's point with that tree's own code
(``experiments/fleet.py`` ``speed``: Llama-3-8B on modelled H200s, ``replicas`` replicas behind the
least-loaded router, ``num_requests`` ShareGPT-like requests at ``speed_rate_per_replica`` each,
fast-forward on) and reports ``Simulator.run``'s CPU seconds (``process_time``), simulated
requests per CPU-second and the records' sha256 (the same on both trees, or the run fails: a
faster simulator must simulate the same thing). Writes ``sim_speed.json`` (every round, medians
and min/max per tree, provenance).
"""

from __future__ import annotations

from pathlib import Path

from experiments import common, tree_ab

ROOT = Path(__file__).resolve().parent.parent

# Runs in the child, importing the measured tree's own ``paged`` and ``experiments``.
_CHILD = r"""
import gc, json, os, sys, time
from experiments import common, fleet
from experiments.configs.fleet import get_config
from paged.fleet.routing import Router
from paged.sim import RooflineStepModel, Simulator
from paged.sim.specs import MODELS
arg = json.loads(sys.argv[1])
c = get_config()
base = common.make_engine_config(c.engine, model="sim")
model = MODELS["Llama-3-8B"]
sm = RooflineStepModel(fleet.device(c), model.with_kv_cache(base), block_size=base.block_size)
cfg = fleet.engine_for(base, model, c.kv_gb)
n, reps = arg["num_requests"], arg["replicas"]
w = fleet.plain_workload(c, n, c.speed_rate_per_replica * reps, cfg.max_model_len)
sim = Simulator(cfg, sm, num_replicas=reps, router=Router("least_loaded"), model_config=sm.model,
                build_device=False)
gc.collect()
t = time.process_time()
res = sim.run(w)
cpu = time.process_time() - t
print("RESULT " + json.dumps({"cpu_s": cpu, "sim_cpu_s": res.cpu_s, "wall_s": res.wall_s,
                              "requests_per_cpu_s": n / cpu, "us_cpu_per_request": 1e6 * cpu / n,
                              "records_sha256": fleet.records_sha256(res),
                              "load_average": os.getloadavg()[0]}))
"""


def check(c) -> dict:
    common.check_positive(num_requests=c.num_requests, rounds=c.rounds, replicas=c.replicas)
    trees = {"this": str(ROOT)}
    if c.baseline:
        base = Path(c.baseline).expanduser().resolve()
        if not (base / "experiments" / "fleet.py").exists():
            raise ValueError(f"baseline={c.baseline!r} holds no experiments/fleet.py")
        trees["baseline"] = str(base)
    return {"trees": trees}


def measure(tree: str, c) -> dict:
    """One child run over ``tree``'s code."""
    return tree_ab.run_child(tree, _CHILD, {"num_requests": c.num_requests, "replicas": c.replicas})


def summarize(rounds: list[dict], trees: dict) -> dict:
    """Median, min and max over rounds of the CPU figures, per tree."""
    out = {}
    for name in trees:
        out[name] = {}
        for key in ("cpu_s", "requests_per_cpu_s", "us_cpu_per_request", "wall_s"):
            xs = [r[name][key] for r in rounds]
            out[name][key] = common.spread(xs)
        out[name]["records_sha256"] = sorted({r[name]["records_sha256"] for r in rounds})
    return out


def main(c, plan):
    out_dir = common.output_dir(c, "sim_speed")
    trees = plan["trees"]
    names = list(trees)
    bar = common.Progress(c.rounds * len(names), "[sim_speed]", unit="run")
    rounds = tree_ab.alternate(trees, c.rounds, lambda path: measure(path, c), bar)
    bar.close()
    summary = summarize(rounds, trees)
    hashes = {h for s in summary.values() for h in s["records_sha256"]}
    for name in names:
        s = summary[name]
        print(f"{name:8s} " + ", ".join(f"{k} {s[k]['median']:.3f} [{s[k]['min']:.3f}, "
                                         f"{s[k]['max']:.3f}]" for k in ("cpu_s", "requests_per_cpu_s"))
              + f"  records {s['records_sha256']}")
    out = out_dir / "sim_speed.json"
    common.write_result(out, {
        "study": "sim_speed", "evidence": "simulated", "config": c.to_dict(),
        "trees": tree_ab.revisions(trees),
        "rounds": rounds, "summary": summary, "provenance": common.provenance()})
    print(f"wrote {out}")
    if len(hashes) != 1:
        raise RuntimeError(f"the trees' records differ: {sorted(hashes)}")


if __name__ == "__main__":
    common.run("sim_speed", main, check)
