"""Every check that needs several devices, in ONE subprocess with four forced CPU host devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=4`` must be set before JAX starts, hence a
process; one for all of them pays JAX's start once, and the scripts' engines share one small model
and one configuration (blocks of 8, 4 sequences, 32-token steps), so their step shapes compile
once for the process. Each script lives beside the single-device tests of its mechanism (the file
it is imported from) and is its own section here: a failing one fails its test only.
"""

from __future__ import annotations

import pytest
from engine_utils import run_sections_on_host_devices
from test_data_parallel import PROCESS_REPLICAS_SCRIPT as PROCESS_REPLICAS
from test_data_parallel import SCRIPT as DATA_PARALLEL
from test_disaggregation import SCRIPT as DISAGGREGATION
from test_kv_quant_engine import MESH_SCRIPT as KV_QUANT_MESH
from test_replay_dp import SCRIPT as REPLAY_DP

# Tensor parallel over KV heads: the engine on a 2-device mesh gives the 1-device tokens (with
# per-layer and with stacked layer params).
MESH = r"""
import sys
sys.path.insert(0, "tests")
import jax
import numpy as np
from engine_utils import prompts, small_model
from paged import Engine, EngineConfig, SamplingParams

assert len(jax.devices()) == 4, jax.devices()
cfg, params = small_model()
conf = EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                    attention_impl="xla", debug_checks=True, min_token_bucket=32, min_seq_bucket=4)
batch = prompts(3, seed=2)
sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
single = [o.token_ids for o in Engine(conf, model_config=cfg, params=params).generate(batch, sp)]
mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
engine = Engine(conf, model_config=cfg, params=params, mesh=mesh)
sharded = [o.token_ids for o in engine.generate(batch, sp)]
assert len(engine.cache.k_pages.sharding.device_set) == 2, engine.cache.k_pages.sharding
assert engine.cache.k_pages.sharding.spec[1] == "model"
assert sharded == single, (sharded, single)
# stacked layers (paged.models.scan_layers): the head axis is one further right
from paged.models.scan_layers import stack_layers
stacked = stack_layers(cfg, params)
engine = Engine(conf, model_config=cfg, params=stacked, mesh=mesh)
assert [o.token_ids for o in engine.generate(batch, sp)] == single
q = engine.placement.put_params(stacked)["params"]["layers"]["attn"]["q_proj"]
assert q.sharding.spec[1] is None and q.sharding.spec[2] == "model", q.sharding.spec
print("MESH_OK")
"""

SECTIONS = {"mesh": MESH, "kv_quant_mesh": KV_QUANT_MESH, "data_parallel": DATA_PARALLEL,
            "disaggregation": DISAGGREGATION, "replay_dp": REPLAY_DP,
            "process_replicas": PROCESS_REPLICAS}


@pytest.fixture(scope="module")
def sections() -> dict:
    return run_sections_on_host_devices(SECTIONS, num_devices=4)


def _passed(sections: dict, name: str, marker: str) -> str:
    ok, out = sections[name]
    assert ok and marker in out, out[-5000:]
    return out


def test_kv_heads_sharded_over_a_mesh(sections):
    """``MESH``: tensor parallel over KV heads gives the 1-device tokens."""
    _passed(sections, "mesh", "MESH_OK")


def test_kv_scales_are_sharded_with_their_heads_and_tokens_do_not_change(sections):
    """`test_kv_quant_engine.MESH_SCRIPT`: int8 pages and their scales on a 2-device mesh."""
    _passed(sections, "kv_quant_mesh", "MESH_OK")


def test_replicas_and_tensor_parallel_give_the_single_device_tokens(sections):
    """`test_data_parallel.SCRIPT`: D x T replicas, preemption, speculation, routing, aborts."""
    _passed(sections, "data_parallel", "DP_OK")


def test_disaggregated_replicas_give_the_single_device_tokens(sections):
    """`test_disaggregation.SCRIPT`: prefill / decode replicas and the hand-over."""
    print(_passed(sections, "disaggregation", "DISAGG_OK"))  # shown with -s: hits, parking, aborts


def test_data_parallel_run_replays_in_lockstep(sections):
    """`test_replay_dp.SCRIPT`: a two-replica serving run replays exactly; a changed router is
    caught at the request it sends elsewhere."""
    out = _passed(sections, "replay_dp", "DP REPLAY OK")
    assert "changed router caught: replay differs at step " in out


def test_process_replicas_give_the_in_process_tokens_routes_and_batches(sections):
    """`test_data_parallel.PROCESS_REPLICAS_SCRIPT`: each replica's host half in its own process
    (``paged.server.replica_process``)."""
    _passed(sections, "process_replicas", "PROCESS_REPLICAS_OK")
