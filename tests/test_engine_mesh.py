"""Tensor parallel over KV heads: the engine on a 2-device mesh gives the 1-device tokens (with
per-layer and with stacked layer params)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine_utils import host_devices_flags

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
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


def test_kv_heads_sharded_over_a_mesh():
    env = dict(os.environ, XLA_FLAGS=host_devices_flags(4), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "MESH_OK" in proc.stdout, proc.stderr[-3000:]
