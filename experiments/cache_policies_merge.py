"""Merges the pieces of one `experiments.cache_policies` grid (each piece a command, one folder,
its own ``cache_policies.json``) into the grid's table and plot, beside the pieces:

    python -m experiments.cache_policies_merge experiments/results/cache_policies/hour

Writes ``<dir>/cache_policies.md`` (every row of every piece, then the capacities) and
``<dir>/cache_policies.png``; reads only the pieces' JSON (their provenance stays with them)."""

from __future__ import annotations

import json
import pathlib
import sys

from experiments.cache_policies import capacity_table, markdown, plot


def merge(root: pathlib.Path) -> tuple[list, list, float]:
    rows, caps, slo = [], [], None
    for f in sorted(root.glob("*/cache_policies.json")):
        d = json.loads(f.read_text())
        for r in d["rows"]:
            rows.append({**r, "piece": f.parent.name})
        caps += d.get("capacities") or []
        slo = d["config"]["ttft_slo_ms"]
    order = {"conversation": 0, "synthetic": 1}
    rows.sort(key=lambda r: (order.get(r["trace"], 2), r["pool_fraction"], r["scheduler"],
                             r["host_fraction"], r["rate_scale"]))
    return rows, caps, slo


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    root = pathlib.Path(argv[1])
    rows, caps, slo = merge(root)
    if not rows:
        raise SystemExit(f"no */cache_policies.json under {root}")
    table = markdown(rows) + ("\n\n" + capacity_table(caps, slo) if caps else "")
    (root / "cache_policies.md").write_text(table + "\n")
    plot([r for r in rows if r["rate_scale"] == 1 and r["scheduler"] == "decode-first"
          and r["host_fraction"] == 0], root / "cache_policies.png")
    print(table)


if __name__ == "__main__":
    main(sys.argv)
