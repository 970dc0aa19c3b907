"""A/B of one measurement over source trees (this checkout and a baseline): each run is a child
Python over one tree's code, rounds alternate the trees' order, and each tree's revision is
recorded. Used by `experiments/host_speed.py` and `experiments/sim_speed.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_child(tree: str, child: str, arg: dict, *, merge: bool = False) -> dict:
    """Runs the source ``child`` with ``arg`` (JSON) over ``tree``'s code; the dict it prints on
    its last ``RESULT `` line (``merge``: the dicts of all its ``RESULT `` lines, later keys
    winning)."""
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.run([sys.executable, "-c", child, json.dumps(arg)], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"child over {tree} failed:\n{proc.stderr[-2000:]}")
    if merge:
        return {k: v for x in lines for k, v in json.loads(x[len("RESULT "):]).items()}
    return json.loads(lines[-1][len("RESULT "):])


def alternate(trees: dict, rounds: int, measure, bar, after_round=None) -> list[dict]:
    """``rounds`` rows of ``{tree name: measure(path)}``, the trees' order reversed every other
    round so neither always runs first."""
    names, out = list(trees), []
    for i in range(rounds):
        row = {}
        for name in names if i % 2 == 0 else names[::-1]:
            row[name] = measure(trees[name])
            bar.update()
        out.append(row)
        if after_round is not None:
            after_round()
    return out


def revision(tree: str) -> str:
    """``tree``'s git revision, or the first line of its ``REVISION`` file (an exported tree)."""
    marker = Path(tree) / "REVISION"
    if marker.exists():
        return marker.read_text().split("\n")[0].strip() + " (REVISION file)"
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "not a git checkout"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def revisions(trees: dict) -> dict:
    return {n: {"path": p, "git_revision": revision(p)} for n, p in trees.items()}
