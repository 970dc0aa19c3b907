"""The ablation's factorial arithmetic (`experiments.ablate`): main effects and interactions of
two-level factors recover a known linear model, per repeat, and the simple ratios pair cells."""

import itertools

import pytest

from experiments import ablate

FACTORS = {"op": ("xla", "reference"), "alloc": ("paged", "contiguous"),
           "sched": ("continuous", "static")}


def _rows(y, repeats=2):
    rows = []
    for rep in range(repeats):
        for levels in itertools.product(*FACTORS.values()):
            f = dict(zip(FACTORS, levels))
            x = {n: 1 if f[n] == FACTORS[n][0] else -1 for n in FACTORS}
            rows.append({"repeat": rep, "cell": ",".join(levels), "factors": f, "wall_s": 1.0,
                         "summary": {m: y(x, rep) for m in ablate.METRICS}})
    return rows


def test_contrasts_recover_a_linear_model():
    # y = 100 + 3 op + 5 alloc - 2 sched + 4 alloc*sched + 1 op*alloc*sched (+ rep on repeat 1)
    def y(x, rep):
        return (100 + 3 * x["op"] + 5 * x["alloc"] - 2 * x["sched"] + 4 * x["alloc"] * x["sched"]
                + x["op"] * x["alloc"] * x["sched"] + 7 * rep * x["alloc"])

    eff = ablate.contrast_effects(_rows(y), FACTORS)
    want = {"op": 6, "alloc": 10, "sched": -4, "op x alloc": 0, "op x sched": 0,
            "alloc x sched": 8, "op x alloc x sched": 2}
    assert set(eff) == set(want)
    for name, value in want.items():
        got = eff[name]["output_throughput"]
        if name == "alloc":  # repeat 1 adds 7 to alloc's coefficient: 10 then 24
            assert got["per_repeat"] == pytest.approx([10, 24]) and got["median"] == 17
        else:
            assert got["per_repeat"] == pytest.approx([value, value]), name
    cells = ablate.cell_summaries(_rows(y))
    assert len(cells) == 8 and all(c["output_throughput"]["n"] == 2 for c in cells.values())


def test_simple_ratios_pair_cells_that_differ_in_one_factor():
    def y(x, rep):
        return 10.0 * (2 if x["alloc"] > 0 else 1) * (1.5 if x["sched"] > 0 else 1)

    ratios = ablate.simple_ratios(_rows(y, repeats=1), FACTORS)
    assert set(ratios["alloc"]) == {"xla,continuous", "xla,static", "reference,continuous",
                                    "reference,static"}
    assert all(r["median"] == pytest.approx(2.0) for r in ratios["alloc"].values())
    assert all(r["median"] == pytest.approx(1.5) for r in ratios["sched"].values())
    assert all(r["median"] == pytest.approx(1.0) for r in ratios["op"].values())


def test_schedule_alternates_the_cell_order():
    assert ablate.schedule(["a", "b", "c"], 3) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c")]
