"""Where the test suite's compile time goes: sums the compile log that ``tests/conftest.py`` writes
when ``PAGED_TEST_COMPILE_LOG`` is set.

Launch::

    PAGED_TEST_COMPILE_LOG=/tmp/compile-log make test
    python -m experiments.suite_profile --compile_log=/tmp/compile-log [--top=25] [--output=prof.json]

Prints, per test file, the seconds spent tracing, lowering and compiling (XLA compilation, or a
load from the persistent compilation cache when the entry was there) and the number of XLA
compilations, then the jitted functions that cost most; ``--output`` writes the same as JSON.
Subprocesses a test starts (forced-device runs, servers, study command lines) are not in the log.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("compile_log", None, "directory holding the per-worker *.jsonl compile logs")
flags.DEFINE_integer("top", 25, "how many files and functions to print")
flags.DEFINE_string("output", None, "optional JSON path for the summary")

EVENTS = ("trace", "lower", "compile")


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
    if FLAGS.output:
        Path(FLAGS.output).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    app.run(main)
