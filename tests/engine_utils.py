"""Shared helpers for engine tests: a small random-weight model and a no-cache reference."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from paged.models.config import LlamaConfig
from paged.models.llama import Llama
from paged.models.registry import init_params

SMALL = LlamaConfig(vocab_size=258, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, ffn_dim=128, max_seq_len=256)


@functools.cache
def small_model(seed: int = 0):
    """Random weights made peaky (embedding x20) so greedy argmax has clear winners."""
    params = init_params(SMALL, seed)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 20.0 if "embedding" in jax.tree_util.keystr(path) else x, params)
    return SMALL, params


def prompts(num: int, *, seed: int = 0, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[256] + rng.integers(0, 256, rng.integers(min_len, max_len)).tolist() for _ in range(num)]


@functools.cache
def _dense_fn(config: LlamaConfig, kv_quant=None):
    model = Llama(config)
    return jax.jit(lambda p, t: model.apply(p, t, method="dense", kv_quant=kv_quant))


def greedy_reference(config: LlamaConfig, params, prompt: list[int], max_tokens: int,
                     eos_id: int = 257, kv_quant=None) -> list[int]:
    """No-cache generation: the full sequence is recomputed densely for every token.

    Tokens are right-padded to one length (causal attention ignores what comes after), a power
    of two (at least 32, at most the model's ``max_seq_len`` when that suffices), so the whole
    generation compiles once and prompts of similar lengths share that compilation.
    ``kv_quant`` = ``(kv_cache_dtype, granularity, page_size)`` reproduces a quantized cache's
    quantize-on-write (``Llama.dense``).
    """
    dense = _dense_fn(config, kv_quant)
    tokens = list(prompt)
    need = len(prompt) + max_tokens
    width = max(32, 1 << (need - 1).bit_length())
    width = need if width > config.max_seq_len >= need else width
    out = []
    for _ in range(max_tokens):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(tokens)] = tokens
        logits = dense(params, jnp.asarray(padded))[0, len(tokens) - 1]
        nxt = int(jnp.argmax(logits))
        out.append(nxt)
        tokens.append(nxt)
        if nxt == eos_id:
            break
    return out


PALLAS = LlamaConfig(vocab_size=258, d_model=64, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=64, ffn_dim=64, max_seq_len=64)  # head_dim 64: TPU-style kernels


@functools.cache
def pallas_model(seed: int = 0):
    """A one-layer random model whose shapes every Pallas kernel style accepts."""
    params = init_params(PALLAS, seed)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 20.0 if "embedding" in jax.tree_util.keystr(path) else x, params)
    return PALLAS, params


def host_devices_flags(num_devices: int) -> str:
    """``XLA_FLAGS`` for a subprocess with ``num_devices`` forced CPU host devices, keeping the
    flags this process runs with (the suite's cheap-compile flags, set in conftest.py)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + [f"--xla_force_host_platform_device_count={num_devices}"])


# Runs each section's script in its own globals, in order, in one process; a section that raises
# is reported and the next one still runs.
_SECTIONS_DRIVER = r"""
import json, sys, traceback
for name, script in json.load(sys.stdin):
    print(f"=== BEGIN {name}", flush=True)
    try:
        exec(compile(script, f"<{name}>", "exec"), {"__name__": "__main__"})
        print(f"=== END {name} ok", flush=True)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        print(f"=== END {name} FAILED", flush=True)
"""


def run_sections_on_host_devices(sections: dict[str, str], num_devices: int = 4) -> dict:
    """Runs several forced-device scripts in ONE new Python process with ``num_devices`` forced
    CPU host devices (one JAX start, and the engines of scripts that share a configuration share
    its compiled step shapes), one after the other. Returns ``name -> (ok, output)``: whether the
    script ran to its end, and what it printed (with its traceback when it raised)."""
    import json

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=host_devices_flags(num_devices))
    proc = subprocess.run([sys.executable, "-c", _SECTIONS_DRIVER],
                          input=json.dumps(list(sections.items())),
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                          text=True, timeout=900)
    out = {}
    for name in sections:
        begin, end = f"=== BEGIN {name}\n", f"=== END {name} "
        if begin not in proc.stdout or end not in proc.stdout:
            out[name] = (False, f"section never ended (exit {proc.returncode}):\n"
                                f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
            continue
        body = proc.stdout.split(begin, 1)[1].split(end, 1)
        out[name] = (body[1].startswith("ok"), body[0] + proc.stderr[-2000:] * (
            not body[1].startswith("ok")))
    return out
