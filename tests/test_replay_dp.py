"""Exact replay of a data-parallel serving run (two replicas behind the router): the record holds
each request's replica and every replica's batch per step; the replay routes again, in
lockstep, and reproduces both, and a changed router is caught at the request it sends elsewhere.
``SCRIPT`` runs in `test_forced_devices`' one subprocess with forced host devices (``XLA_FLAGS``
must be set before JAX starts; two are used); the device-count check of the command line runs here
on one device."""

from __future__ import annotations

import json

import jax
import pytest

from experiments import replay as rp

SCRIPT = r"""
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, "tests")
import jax
from replay_utils import CONFIG, run_on_clock, workload
from experiments import common, serving
from experiments import replay as rp
from paged import Engine, EngineConfig

assert len(jax.devices()) >= 2, jax.devices()
model = common.load_model("random-small")
config = EngineConfig(**CONFIG, data_parallel_size=2, router="prefix_aware",
                      router_load_threshold=1)  # hits win only while loads stay close
engine = Engine(config, model_config=model[0], params=model[1])
result = run_on_clock("dp", engine, workload(16, 0.003), max_wall_s=0.06, timeouts={"r05": 0.01})
record = json.loads(json.dumps(result.replay))
statuses = set(record["statuses"].values())
assert {"finished", "timeout", "aborted"} <= statuses, statuses
assert record["fresh_engine"] and {r["replica"] for r in record["requests"]} == {0, 1}
assert all(len(s["batch"]) == len(s["preempted"]) == 2 for s in record["steps"])
assert any(s["batch"][0] and s["batch"][1] for s in record["steps"])  # both replicas ran at once
assert any(p for s in record["steps"] for p in s["preempted"]), "no preemption"
out = Path(tempfile.mkdtemp(prefix="test_replay_dp_"))
serving.write_replay(out / "replay.json", [result])
how = "reproduce: " + rp.replay_command(out, devices=2)
got = rp.replay(record, model)
assert got.ok and got.num_steps == len(record["steps"]), (got.divergence.format(), how)
assert rp.main([f"--from={out}"]) == 0
# A changed router sends some request elsewhere: caught there, before the step it joins.
changed = rp.replay(record, model, router="round_robin")
assert not changed.ok and changed.divergence.field.startswith("replica of "), changed
print("changed router caught:", changed.divergence.format().splitlines()[0])
# The engine served a run; emptied (prefix caches, a new router) it starts cold and replays.
serving.start_cold(engine)
again = run_on_clock("dp-again", engine, workload(6, 0.0))
assert again.replay["fresh_engine"], "not cold after start_cold"
assert rp.replay(again.replay, model).ok
print("DP REPLAY OK")
"""


def test_cli_names_the_devices_a_data_parallel_record_needs(tmp_path, capsys):
    if len(jax.devices()) >= 2:
        pytest.skip("this process has two devices: the record would replay")
    record = {"version": 1, "arm": "dp", "model": "random-small", "requests": [], "steps": [],
              "tokens": {}, "engine_config": {"data_parallel_size": 2, "tensor_parallel_size": 1}}
    (tmp_path / "replay.json").write_text(json.dumps({"arms": [record]}))
    with pytest.raises(SystemExit) as e:
        rp.main([f"--from={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err
    assert f"XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m experiments.replay " \
           f"--from={tmp_path}" in err
    with pytest.raises(SystemExit):
        rp.main([f"--from={tmp_path}", "--sim"])
    assert "single-device runs" in capsys.readouterr().err
