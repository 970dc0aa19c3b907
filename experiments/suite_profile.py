"""Where the test suite's compile time goes: sums the compile log that ``tests/conftest.py`` writes
when ``PAGED_TEST_COMPILE_LOG`` is set.

Launch::

    PAGED_TEST_COMPILE_LOG=/tmp/compile-log make test
    python -m experiments.suite_profile --compile_log=/tmp/compile-log [--top=25] [--output=prof.json]

Prints, per test file, the seconds spent tracing, lowering and compiling (XLA compilation, or a
load from the persistent compilation cache when the entry was there) and the number of XLA
compilations, then the jitted functions that cost most; ``--output`` writes the same as JSON.
Subprocesses a test starts (forced-device runs, servers, study command lines) are not in the log.

A timed run (the suite's own numbers, kept as a result with provenance)::

    PAGED_TEST_JAX_CACHE=$(mktemp -d) PAGED_TEST_COMPILE_LOG=/tmp/log /usr/bin/time -v \
        python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=0 tests \
        > /tmp/pytest.txt 2>&1
    python -m experiments.suite_profile --compile_log=/tmp/log --pytest_output=/tmp/pytest.txt \
        --measured_revision=REV --result=experiments/results/suite_profile/NAME.json

``--pytest_output`` (pytest's ``--durations=0`` report, with ``/usr/bin/time -v``'s lines after
it) adds the tests passed, pytest's wall seconds, the process tree's wall and CPU seconds and
the seconds per test file (setup + call + teardown) with the worker that ran it (from the
compile log; files that compile nothing in-process have none); ``--result`` writes all of it
with `experiments.common.write_result`.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("compile_log", None, "directory holding the per-worker *.jsonl compile logs")
flags.DEFINE_integer("top", 25, "how many files and functions to print")
flags.DEFINE_string("output", None, "optional JSON path for the summary")
flags.DEFINE_string("pytest_output", None, "pytest --durations=0 output (+ /usr/bin/time -v)")
flags.DEFINE_string("measured_revision", None, "the revision the timed suite ran at")
flags.DEFINE_string("result", None, "optional result JSON (with provenance) of a timed run")
flags.DEFINE_list("shapes_fun", ["step"], "the jitted functions whose distinct shapes are counted "
                  "(the first in ``shapes``, the others in ``shapes_more``; since the step became "
                  "two calls: step_forward,step_sample)")

EVENTS = ("trace", "lower", "compile")
POOL_AXIS = re.compile(r"((?:float|int|uint|bfloat)\w*\[\d+,\d+,)\d+(,\d+(?:,\d+)?\])")


def summarize(log_dir: Path) -> dict:
    """Seconds per event kind, per test file and per jitted function, plus compile counts."""
    files = list(log_dir.glob("*.jsonl"))
    if not files:
        raise ValueError(f"no *.jsonl compile logs in {log_dir}")
    per_file: dict = collections.defaultdict(lambda: dict.fromkeys(EVENTS, 0.0) | {"compiles": 0})
    per_fun: dict = collections.defaultdict(lambda: dict.fromkeys(EVENTS, 0.0) | {"compiles": 0})
    totals = dict.fromkeys(EVENTS, 0.0)
    for path in files:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["event"] not in EVENTS:  # "start": a test began (which worker ran it)
                continue
            test_file = r["test"].split("::")[0]
            fun = r["fun"][4:-1] if r["fun"].startswith("jit(") else r["fun"]  # trace: bare name
            for row in (per_file[test_file], per_fun[fun]):
                row[r["event"]] += r["seconds"]
                row["compiles"] += r["event"] == "compile"
            totals[r["event"]] += r["seconds"]

    def ranked(rows: dict) -> list:
        out = [{"name": k, **{e: round(v[e], 2) for e in EVENTS}, "compiles": v["compiles"],
                "total": round(sum(v[e] for e in EVENTS), 2)} for k, v in rows.items()]
        return sorted(out, key=lambda r: -r["total"])

    return {"totals": {k: round(v, 1) for k, v in totals.items()},
            "files": ranked(per_file), "functions": ranked(per_fun)}


def shapes(log_dir: Path, fun: str = "step") -> dict:
    """Distinct compiled shapes of the jitted ``fun`` (the "shapes" lines: one per lowering, with
    a digest of the argument shapes and types), per test file, and how many files share each:
    a shape lowered in several files (or workers) is traced and lowered in each, and compiled
    once if the persistent compile cache serves the others."""
    per_file: dict = collections.defaultdict(collections.Counter)
    clears = collections.Counter()  # jax.clear_caches() calls (conftest's limits), per worker
    avals: dict = {}
    for path in sorted(log_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            clears[path.stem] += r["event"] == "clear_caches"
            if r["event"] != "shapes" or r["fun"] not in (fun, f"jit({fun})"):
                continue
            per_file[r["test"].split("::")[0]][r["key"]] += 1
            if "avals" in r:
                avals[r["key"]] = r["avals"]
    files_of: dict = collections.defaultdict(set)
    for name, keys in per_file.items():
        for key in keys:
            files_of[key].add(name)
    rows = [{"name": name, "lowerings": sum(keys.values()), "distinct": len(keys),
             "shared": sum(len(files_of[k]) > 1 for k in keys)}
            for name, keys in per_file.items()]
    return {"fun": fun, "clear_caches": dict(clears), "lowerings": sum(r["lowerings"] for r in rows),
            "distinct": len(files_of),
            # what one pool size for every engine would leave: the pages axis of the KV pages
            # (5-d) and of their scales (4-d float) read as one size
            "distinct_any_pool": len({POOL_AXIS.sub(r"\1N\2", avals.get(k, k)) for k in files_of}),
            "files": sorted(rows, key=lambda r: -r["distinct"]),
            "shared": sorted(([k, sorted(v)] for k, v in files_of.items() if len(v) > 1),
                             key=lambda kv: -len(kv[1]))}


def timed_run(text: str, summary: dict, log_dir: Path) -> dict:
    """The pytest report's totals and per-file seconds, the worker of each file (compile log)."""
    per_file: dict = collections.defaultdict(float)
    for m in re.finditer(r"^([\d.]+)s (?:setup|call|teardown)\s+([^:\s]+)::", text, re.M):
        per_file[m.group(2)] += float(m.group(1))
    worker = {}
    for path in sorted(log_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            worker.setdefault(json.loads(line)["test"].split("::")[0], path.stem)
    passed = re.search(r"(\d+) passed.* in ([\d.]+)s", text)
    time_v = dict(re.findall(r"^\s*(User time \(seconds\)|System time \(seconds\)|"
                             r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\)): (\S+)", text,
                             re.M))

    def seconds(clock: str) -> float:
        return sum(float(x) * 60**i for i, x in enumerate(reversed(clock.split(":"))))

    run = {"passed": int(passed.group(1)) if passed else None,
           "pytest_wall_s": float(passed.group(2)) if passed else None}
    if time_v:
        run["wall_s"] = round(seconds(time_v["Elapsed (wall clock) time (h:mm:ss or m:ss)"]), 2)
        run["cpu_s"] = round(float(time_v["User time (seconds)"])
                             + float(time_v["System time (seconds)"]), 2)
    files = [{"name": k, "seconds": round(v, 2), "worker": worker.get(k)}
             for k, v in sorted(per_file.items(), key=lambda kv: -kv[1])]
    by_worker: dict = collections.defaultdict(float)
    for f in files:
        by_worker[f["worker"] or "unknown"] += f["seconds"]
    return {**run, "test_seconds": round(sum(per_file.values()), 1),
            "test_seconds_per_worker": {k: round(v, 1) for k, v in sorted(by_worker.items())},
            "test_files": files,
            "compile": {**summary, "functions": summary["functions"][:60]}}  # the costliest 60


def _print_shapes(sh: dict) -> None:
    if not sh["lowerings"]:
        return
    print(f"\n`{sh['fun']}` shapes: {sh['lowerings']} lowerings, {sh['distinct']} distinct "
          f"({sh['distinct_any_pool']} if every pool had one size) "
          f"(jax.clear_caches calls per worker: {sh['clear_caches']}; per file: lowerings, "
          "distinct, distinct ones other files lower too):")
    for r in sh["files"][:FLAGS.top]:
        print(f"  {r['lowerings']:5d} {r['distinct']:5d} {r['shared']:5d}  {r['name']}")


def main(argv):
    del argv
    if not FLAGS.compile_log:
        sys.exit("suite_profile: --compile_log is required")
    try:
        summary = summarize(Path(FLAGS.compile_log))
    except ValueError as e:
        sys.exit(f"suite_profile: {e}")
    print("seconds: " + ", ".join(f"{k} {v}" for k, v in summary["totals"].items()))
    for what in ("files", "functions"):
        print(f"\n{what} (trace / lower / compile seconds, XLA compiles):")
        for r in summary[what][:FLAGS.top]:
            print(f"  {r['total']:8.1f}  {r['trace']:7.1f} {r['lower']:7.1f} {r['compile']:7.1f}"
                  f"  {r['compiles']:5d}  {r['name']}")
    funs = [shapes(Path(FLAGS.compile_log), f) for f in FLAGS.shapes_fun]
    summary["shapes"] = funs[0]
    if funs[1:]:
        summary["shapes_more"] = {sh["fun"]: sh for sh in funs[1:]}
    for sh in funs:
        _print_shapes(sh)
    if FLAGS.output:
        Path(FLAGS.output).write_text(json.dumps(summary, indent=1))
    if FLAGS.pytest_output:
        run = timed_run(Path(FLAGS.pytest_output).read_text(), summary, Path(FLAGS.compile_log))
        print(f"\n{run['passed']} passed, pytest {run['pytest_wall_s']} s, wall "
              f"{run.get('wall_s')} s, CPU {run.get('cpu_s')} s; test seconds per worker "
              f"{run['test_seconds_per_worker']}")
        if FLAGS.result:
            from experiments import common

            common.write_result(FLAGS.result, {
                "evidence": "real", "what": "the default test suite, timed (cold compile cache)",
                "measured_revision": FLAGS.measured_revision, **run},
                inputs=[FLAGS.pytest_output])


if __name__ == "__main__":
    app.run(main)
