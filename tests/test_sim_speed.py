"""The simulator-speed study's smoke run: this tree's own child run, no baseline."""

import pytest

from experiments import sim_speed
from experiments.configs.sim_speed import get_config


def test_smoke_measures_this_tree_and_summarizes():
    c = get_config("smoke")
    plan = sim_speed.check(c)
    assert list(plan["trees"]) == ["this"]
    row = sim_speed.measure(plan["trees"]["this"], c)
    assert row["cpu_s"] > 0 and row["requests_per_cpu_s"] > 0 and len(row["records_sha256"]) == 16
    summary = sim_speed.summarize([{"this": row}], plan["trees"])
    assert summary["this"]["cpu_s"]["median"] == row["cpu_s"]


def test_bad_baseline_fails_before_running():
    c = get_config("smoke")
    with c.unlocked():
        c.baseline = "/nonexistent"
    with pytest.raises(ValueError, match="baseline"):
        sim_speed.check(c)


def test_breakdown_times_the_parts_and_keeps_the_records():
    c = get_config("smoke")
    plan = sim_speed.check(c)
    tree = plan["trees"]["this"]
    plain, parts = sim_speed.measure(tree, c), sim_speed.breakdown(tree, c)
    assert parts["records_sha256"] == plain["records_sha256"]
    rows = {r["part"]: r for r in parts["rows"]}
    assert len(rows) == len(sim_speed.BREAKDOWN)  # every part is found in this tree
    assert rows["arrival: route + add_request"]["calls"] == c.num_requests
    assert rows["fleet_summary"]["calls"] == 1
    assert rows["apply_stretch"]["calls"] > 0 and rows["plan_stretch (planned a stretch)"]["calls"] > 0
    assert "| apply_stretch |" in sim_speed.format_breakdown(parts["rows"])
