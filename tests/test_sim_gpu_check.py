"""`experiments.sim_gpu_check` (device_check.sh stage ``simval``) before any serving: its configs
build a real trace window and an engine config, and its two roofline variants price the served
model's own weight and KV bytes (the serving run itself is the device check's dry run)."""

from __future__ import annotations

import pytest

from experiments import sim_gpu_check
from experiments.configs.sim_gpu_check import get_config


@pytest.mark.parametrize("variant", ["smoke", "default"])
def test_check_builds_a_real_window(variant):
    plan = sim_gpu_check.check(get_config(variant))
    w = plan["workload"]
    assert w.evidence == "real" and len(w) > 0
    assert [d["name"] for d in w.meta["derived"]][0] == "window"
    assert (plan["model_cfg"] is None) == (variant == "smoke")


def test_step_models_use_the_served_bytes():
    c = get_config("smoke")
    plan = sim_gpu_check.check(c)
    model = sim_gpu_check.load(c, plan)
    models = sim_gpu_check.step_models(model, plan["engine_config"], bandwidth=1e10)
    h200, measured = models["roofline_h200"], models["roofline_measured"]
    assert h200.device.mem_bandwidth == 3.1e12 and measured.device.mem_bandwidth == 1e10
    assert h200.model.bytes_per_param == 4 and h200.model.bytes_per_kv == 4  # float32 tiny
    assert h200.model.num_layers == model[0].num_layers


def test_bad_window_is_refused():
    c = get_config("smoke")
    c.workload.window = (1e7, 1e7 + 1)
    with pytest.raises(ValueError):
        sim_gpu_check.check(c)
