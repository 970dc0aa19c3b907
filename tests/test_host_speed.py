"""The host-speed study's smoke run: this tree's own replay, no baseline, no nano-vllm."""

import pytest

from experiments import host_speed
from experiments.configs.host_speed import get_config


def test_smoke_measures_this_tree_and_summarizes():
    c = get_config("smoke")
    plan = host_speed.check(c)
    assert list(plan["trees"]) == ["this"]
    row = host_speed.measure(plan["trees"]["this"], c)
    step = row["batch"]["decode_step"]["ours_p50_us"]
    assert step > 0 and row["batch"]["whole_step_with_churn"]["ours_p50_us"] > 0
    summary = host_speed.summarize([{"this": row}], plan["trees"], c.apis)
    assert summary["this"]["batch"]["decode_step"]["ours_p50_us"]["median"] == step


def test_bad_settings_fail_before_running():
    c = get_config("smoke")
    with c.unlocked():
        c.baseline = "/nonexistent"
    with pytest.raises(ValueError, match="baseline"):
        host_speed.check(c)
    c = get_config("smoke")
    with c.unlocked():
        c.apis = ()
    with pytest.raises(ValueError, match="apis"):
        host_speed.check(c)


def test_gc_mode_is_honoured_in_the_child():
    """gc="off": no collection runs during the replay; "frozen": the collector runs as usual."""
    c = get_config("smoke")
    tree = host_speed.check(c)["trees"]["this"]
    assert c.gc == "off"
    off = host_speed.measure(tree, c)["batch"]
    assert off["gc_collections"] == [0, 0, 0] and off["gc_ms"] == 0
    assert off["decode_step"]["ours_p50_us"] > 0
    frozen = host_speed.measure(tree, c, "frozen")["batch"]
    assert sum(frozen["gc_collections"]) > 0 and frozen["gc_ms"] > 0
    assert frozen["gc_ms_by_side"]["ours"] > 0 and frozen["gc_ms_by_side"]["nanovllm"] == 0


def test_gc_modes_make_arms_and_bad_ones_fail():
    c = get_config("smoke")
    with c.unlocked():
        c.gc = "off,frozen"
    arms = host_speed.check(c)["arms"]
    assert arms == {"this gc=off": {"tree": "this", "gc": "off"},
                    "this gc=frozen": {"tree": "this", "gc": "frozen"}}
    with pytest.raises(ValueError, match="several"):
        host_speed.measure(str(host_speed.ROOT), c)
    for bad in ("of", "off,off", ""):
        with c.unlocked():
            c.gc = bad
        with pytest.raises(ValueError, match="gc="):
            host_speed.check(c)
