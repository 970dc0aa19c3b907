"""Decode step time of one engine configuration: a fixed batch, all decoding, steps timed serially.

The capacity study runs it once per arm so that a difference in capacity can be told apart from a
difference in step cost (a quantized KV format, say, whose dequantize the CPU XLA path pays in
its own way). Every arm is probed at the same batch and context, on a pool sized so that the
batch fits (``num_blocks=None``): a per-step cost, not a capacity.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from paged import Engine, EngineConfig, SamplingParams


def decode_step_time(engine_config: EngineConfig, model, *, num_seqs: int, prompt_len: int,
                     steps: int, warmup_steps: int = 2, seed: int = 0) -> dict:
    """Median wall time of ``steps`` decode steps of ``num_seqs`` sequences.

    Args:
      engine_config: the arm's settings; the probe runs them with ``num_blocks=None`` (a pool
        that holds ``max_num_seqs`` requests of ``max_model_len``), the serial step
        (``async_scheduling=False``, so the device phase is the wait for the step's tokens) and
        no prefix caching (random prompts share nothing anyway).
      model: ``(config, params)`` (`experiments.common.load_model`).
      num_seqs: sequences decoding together (at most ``max_num_seqs``).
      prompt_len: prompt tokens of each sequence.
      steps: decode steps timed, after ``warmup_steps`` untimed ones.
      seed: seed of the random prompts.

    Returns:
      ``median_step_ms`` (the whole ``step()`` call), ``median_device_ms`` (the wait for the
      sampled tokens), ``median_host_ms``, and the probe's shape.

    Raises:
      ValueError: a batch that does not fit ``max_num_seqs`` or ``max_model_len``.
    """
    budget = engine_config.max_model_len - prompt_len
    if not 1 <= num_seqs <= engine_config.max_num_seqs:
        raise ValueError(f"num_seqs={num_seqs} must be in [1, max_num_seqs="
                         f"{engine_config.max_num_seqs}]")
    if prompt_len < 1 or budget < warmup_steps + steps + 1:
        raise ValueError(f"prompt_len={prompt_len} + {warmup_steps + steps + 1} decode steps "
                         f"exceed max_model_len={engine_config.max_model_len}")
    cfg = dataclasses.replace(engine_config, num_blocks=None, async_scheduling=False,
                              enable_prefix_caching=False)
    engine = Engine(cfg, model_config=model[0], params=model[1])
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"probe{i}", rng.integers(0, vocab, prompt_len).tolist(), params)
    while engine.scheduler.waiting or any(not s.is_decoding for s in engine.scheduler.running):
        engine.step()
    for _ in range(warmup_steps):
        engine.step()
    walls, device, host = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        t = engine.last_timing
        if t.num_seqs != num_seqs:
            raise RuntimeError(f"expected {num_seqs} decoding sequences, stepped {t.num_seqs}")
        device.append(t.device)
        host.append(t.host)
    return {"num_seqs": num_seqs, "prompt_len": prompt_len, "steps": steps,
            "median_step_ms": 1e3 * float(np.median(walls)),
            "median_device_ms": 1e3 * float(np.median(device)),
            "median_host_ms": 1e3 * float(np.median(host))}
