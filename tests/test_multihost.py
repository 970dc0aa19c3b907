"""One engine over two processes (``jax.distributed`` on 127.0.0.1, gloo collectives): tensor
parallel over the four CPU devices of both gives the single-device greedy tokens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from engine_utils import host_devices_flags

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import sys
sys.path.insert(0, "tests")
from paged.engine import multihost

port, pid = sys.argv[1], int(sys.argv[2])
multihost.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import jax
from engine_utils import prompts
from paged import Engine, EngineConfig, SamplingParams
from paged.models.config import LlamaConfig
from paged.models.registry import init_params

assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
cfg = LlamaConfig(vocab_size=258, d_model=64, num_layers=2, num_heads=4, num_kv_heads=4,
                  head_dim=16, ffn_dim=128, max_seq_len=256)
params = jax.tree_util.tree_map_with_path(  # peaky embeddings: clear greedy winners
    lambda path, x: x * 20.0 if "embedding" in jax.tree_util.keystr(path) else x,
    init_params(cfg, 0))
conf = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
            attention_impl="xla", debug_checks=True, min_token_bucket=32, min_seq_bucket=4)
shared = [256] + list(range(1, 17))
batch = prompts(4, seed=5) + [shared + [50], shared + [51]]
sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
if pid == 0:  # the reference: one local device, no other process involved
    local = Engine(EngineConfig(**conf), model_config=cfg, params=params,
                   devices=jax.local_devices()[:1])
    single = [o.token_ids for o in local.generate(batch, sp)]
    single += [o.token_ids for o in local.generate([shared + [52]], sp)]
engine = Engine(EngineConfig(**conf, tensor_parallel_size=4), model_config=cfg, params=params,
                devices=jax.devices())
assert len(engine.cache.k_pages.sharding.device_set) == 4
if pid == 0:
    got = [o.token_ids for o in engine.generate(batch, sp)]
    got += [o.token_ids for o in engine.generate([shared + [52]], sp)]  # a prefix-cache hit
    hits = engine.kv_stats()["prefix_cache_hit_tokens"]
    multihost.stop_followers(engine)
    assert got == single, (got, single)
    assert hits >= 16, hits
    print("MH_OK", flush=True)
else:
    try:
        engine.add_request("x", [256, 1])
        raise AssertionError("a follower took a request")
    except RuntimeError:
        pass
    print("FOLLOWED", multihost.follow(engine), flush=True)
jax.distributed.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_tensor_parallel_match_one_device():
    env = dict(os.environ, XLA_FLAGS=host_devices_flags(2),
               JAX_PLATFORMS="cpu")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, port, str(i)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    leader, follower = outs
    assert procs[0].returncode == 0 and "MH_OK" in leader[0], leader[0] + leader[1][-3000:]
    assert procs[1].returncode == 0 and "FOLLOWED" in follower[0], follower[0] + follower[1][-3000:]
