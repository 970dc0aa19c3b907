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

    Tokens are right-padded to one length (causal attention ignores what comes after), so the
    whole generation compiles once. ``kv_quant`` = ``(kv_cache_dtype, granularity, page_size)``
    reproduces a quantized cache's quantize-on-write (``Llama.dense``).
    """
    dense = _dense_fn(config, kv_quant)
    tokens = list(prompt)
    width = len(prompt) + max_tokens
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


def run_on_host_devices(script: str, marker: str, num_devices: int = 4) -> str:
    """Runs ``script`` in a new Python process with ``num_devices`` forced CPU host devices
    (``XLA_FLAGS`` must be set before JAX starts, hence the process), from the repository root;
    asserts it exited 0 and printed ``marker``; returns its stdout."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=host_devices_flags(num_devices))
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and marker in proc.stdout, proc.stdout + proc.stderr[-3000:]
    return proc.stdout
