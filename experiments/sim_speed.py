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

With ``breakdown``, one more child run of this tree times the simulator's parts (`BREAKDOWN`:
arrivals, planning and applying stretches, the block manager's decode runs and keying, ordinary
steps, records and the summary), each call wrapped with ``perf_counter`` (inclusive: a part's
time holds the parts it calls): calls per simulated request and microseconds per call and per
request, under the ``breakdown`` key. The wrappers add about a tenth of a microsecond per call,
so that run's own CPU time is not a speed figure.
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


# (module, attribute path, label): the parts ``breakdown`` times, looked up where the simulator
# calls them; a part the tree lacks is left out. A label ending "a stretch)" counts only the
# calls that returned something (planned or continued a stretch).
BREAKDOWN = (
    ("paged.sim.event_loop", "EventLoop.arrive", "arrival: route + add_request"),
    ("paged.sim.replica", "SimReplica.add_request", "SimReplica.add_request"),
    ("paged.sim.replica", "plan_stretch", "plan_stretch (planned a stretch)"),
    ("paged.sim.replica", "SimReplica.continue_at", "SimReplica.continue_at (continued a stretch)"),
    ("paged.sim.replica", "SimReplica.advance_to", "SimReplica.advance_to"),
    ("paged.sim.replica", "apply_stretch", "apply_stretch"),
    ("paged.kv.block_manager", "BlockManager.run_decode_steps", "BlockManager.run_decode_steps"),
    ("paged.kv.blocks.prefix_index", "PrefixKeyer.key_computed", "PrefixKeyer.key_computed"),
    ("paged.step.readback", "StepReader.stops_and_outputs", "StepReader.stops_and_outputs"),
    ("paged.sim.replica", "SimReplica.begin", "SimReplica.begin (ordinary step)"),
    ("paged.step.host_core", "HostCore.schedule", "HostCore.schedule"),
    ("paged.sim.replica", "SimReplica.finish", "SimReplica.finish (ordinary step)"),
    ("paged.sim.event_loop", "record_of", "record_of"),
    ("paged.sim.event_loop", "fleet_summary", "fleet_summary"),
)

# Runs in the child before ``_CHILD``: wraps the parts of ``arg["breakdown"]``; their rows are
# printed at exit as a second ``RESULT`` line (``{"rows": [...]}``).
_WRAP = r"""
import atexit, importlib, json, sys, time
_arg = json.loads(sys.argv[1])
_acc = {}
def _wrap(mod, path, label):
    m = importlib.import_module(mod)
    *owner_path, name = path.split(".")
    owner = m
    for part in owner_path:
        owner = getattr(owner, part, None)
    f = getattr(owner, name, None) if owner is not None else None
    if not callable(f):  # absent in this tree, or not a function (say, a slot of that name)
        return
    acc = _acc[label] = [0.0, 0]
    skip_none = label.endswith("a stretch)")  # only the calls that planned one
    def wrapped(*a, _f=f, _acc=acc, **k):
        t = time.perf_counter()
        out = _f(*a, **k)
        if out is not None or not skip_none:
            _acc[0] += time.perf_counter() - t
            _acc[1] += 1
        return out
    setattr(owner, name, wrapped)
for mod, path, label in _arg.get("breakdown", ()):
    _wrap(mod, path, label)
def _report():
    n = _arg["num_requests"]
    rows = [{"part": k, "calls": c, "calls_per_request": c / n,
             "us_per_call": 1e6 * t / c if c else None, "us_per_request": 1e6 * t / n}
            for k, (t, c) in _acc.items()]
    print("RESULT " + json.dumps({"rows": rows}))
if _acc:
    atexit.register(_report)
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


def breakdown(tree: str, c) -> dict:
    """One child run over ``tree``'s code with the parts of `BREAKDOWN` timed: its RESULT row
    (CPU time inflated by the wrappers) with ``rows`` (one dict per part found)."""
    arg = {"num_requests": c.num_requests, "replicas": c.replicas,
           "breakdown": [list(b) for b in BREAKDOWN]}
    return tree_ab.run_child(tree, _WRAP + _CHILD, arg, merge=True)


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


def format_breakdown(rows: list[dict]) -> str:
    """The breakdown's rows as a markdown table."""
    lines = ["| part | calls per request | us per call | us per request |", "| --- | --- | --- | --- |"]
    for r in rows:
        per = "" if r["us_per_call"] is None else f"{r['us_per_call']:.1f}"
        lines.append(f"| {r['part']} | {r['calls_per_request']:.2f} | {per} | "
                     f"{r['us_per_request']:.1f} |")
    return "\n".join(lines)


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
    parts = None
    if c.breakdown:
        parts = breakdown(trees["this"], c)
        hashes.add(parts["records_sha256"])
        print(format_breakdown(parts["rows"]))
    out = out_dir / "sim_speed.json"
    common.write_result(out, {
        "study": "sim_speed", "evidence": "simulated", "config": c.to_dict(),
        "trees": tree_ab.revisions(trees),
        "rounds": rounds, "summary": summary, "breakdown": parts,
        "provenance": common.provenance()})
    print(f"wrote {out}")
    if len(hashes) != 1:
        raise RuntimeError(f"the trees' records differ: {sorted(hashes)}")


if __name__ == "__main__":
    common.run("sim_speed", main, check)
