"""Trains the bundled byte-level models ("tiny", "tiny-draft") on the Python stdlib sources.

    nice -n 5 .venv/bin/python -m experiments.train_tiny --config=experiments/configs/train_tiny.py:tiny

Writes ``<output_dir>/<name>.npz`` (float16 params) and ``<name>.json`` (config, losses, wall time,
this command, JAX version, corpus); ``output_dir`` defaults to ``results/train_tiny/<UTC
timestamp>/``, and ``--config.output_dir=paged/models/weights`` replaces the bundled weights. The corpus and its held-out split are described in
`paged.models.corpus`. AdamW with linear warmup and cosine decay; dense causal training through
``Llama.dense`` (the same params then serve from paged KV).
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments import common
from paged.models import corpus
from paged.models.config import LlamaConfig
from paged.models.llama import Llama
from paged.models.registry import init_params, num_params, save_model

DEFAULT_CONFIG = str(Path(__file__).resolve().parent / "configs" / "train_tiny.py") + ":tiny"


def _windows(stream: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:  # i32[B, length]
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int32)


def train(config: ml_collections.ConfigDict, *, command: str = "") -> dict:
    """Trains one model as ``config`` says and saves it to ``config.output_dir``.

    Returns:
      The json record written next to the weights.
    """
    if not 0 <= config.warmup_steps < config.steps:
        raise ValueError(f"warmup_steps={config.warmup_steps} must be in [0, steps={config.steps})")
    t0 = time.time()
    model_config = LlamaConfig(**config.model.to_dict())
    train_files, eval_files = corpus.stdlib_files()
    if config.max_train_files:
        train_files = train_files[: config.max_train_files]
    if config.max_eval_files:
        eval_files = eval_files[: config.max_eval_files]
    train_stream = corpus.encode_files(train_files)
    eval_stream = corpus.encode_files(eval_files)
    window = config.seq_len + 1
    if min(len(train_stream), len(eval_stream)) <= window:
        raise ValueError(f"corpus shorter than seq_len={config.seq_len}")
    corpus_text = corpus.describe(
        len(train_files), len(eval_files), len(train_stream), len(eval_stream)
    )
    print(f"[{config.name}] corpus: {corpus_text}", flush=True)

    model = Llama(model_config)
    params = jax.tree.map(jnp.asarray, init_params(model_config, config.seed))
    print(f"[{config.name}] {num_params(params):,} params, {model_config}", flush=True)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=config.steps,
        end_value=config.learning_rate * config.min_lr_ratio,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(
            schedule,
            b1=config.b1,
            b2=config.b2,
            weight_decay=config.weight_decay,
            mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
        ),
    )
    opt_state = tx.init(params)

    def loss_fn(params, batch):  # batch i32[B, seq_len + 1]
        logits = model.apply(params, batch[:, :-1], method="dense")
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def eval_loss(params, batch):
        return loss_fn(params, batch)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step = jax.jit(train_step, donate_argnums=(0, 1))

    eval_starts = np.linspace(0, len(eval_stream) - window, config.eval_windows).astype(np.int64)
    eval_batches = [
        _windows(eval_stream, eval_starts[i : i + config.batch_size], window)
        for i in range(0, len(eval_starts), config.batch_size)
    ]

    def evaluate(params) -> float:
        losses = [float(eval_loss(params, b)) * len(b) for b in eval_batches]
        return sum(losses) / len(eval_starts)

    rng = np.random.default_rng(config.seed)
    history, recent = [], []
    t_train = time.time()
    bar = common.Progress(config.steps, f"[{config.name}]", unit="step")
    for step in range(1, config.steps + 1):
        starts = rng.integers(0, len(train_stream) - window, config.batch_size)
        params, opt_state, loss = train_step(
            params, opt_state, _windows(train_stream, starts, window)
        )
        recent.append(loss)
        bar.update()
        if step % config.log_every == 0 or step == config.steps:
            mean = float(np.mean(jax.device_get(recent)))
            recent = []
            elapsed = time.time() - t_train
            tok_s = step * config.batch_size * config.seq_len / elapsed
            print(
                f"[{config.name}] step {step}/{config.steps} loss {mean:.4f} "
                f"lr {float(schedule(step)):.2e} {tok_s:,.0f} tok/s {elapsed:.0f}s",
                flush=True,
            )
            history.append({"step": step, "train_loss": mean})
        if step % config.eval_every == 0 or step == config.steps:
            ev = evaluate(params)
            print(f"[{config.name}] step {step} eval loss {ev:.4f}", flush=True)
            history.append({"step": step, "eval_loss": ev})
    bar.close()
    final_train = next(h["train_loss"] for h in reversed(history) if "train_loss" in h)
    final_eval = next(h["eval_loss"] for h in reversed(history) if "eval_loss" in h)
    wall = time.time() - t0
    meta = {
        "tokenizer": "ByteTokenizer: UTF-8 bytes 0..255, BOS 256, EOS 257",
        "steps": config.steps,
        "tokens_seen": config.steps * config.batch_size * config.seq_len,
        "final_train_loss": round(final_train, 4),
        "final_eval_loss": round(final_eval, 4),
        "final_eval_bits_per_byte": round(final_eval / np.log(2), 4),
        "loss_note": "mean next-token cross entropy in nats; train = mean of the last log_every "
        "steps, eval = fixed held-out windows",
        "wall_time_s": round(wall, 1),
        "command": command,
        "jax_version": jax.__version__,
        "python_version": platform.python_version(),
        "devices": [str(d) for d in jax.devices()],
        "corpus": corpus_text,
        "train_config": config.to_dict(),
        "history": history,
    }
    npz, js = save_model(
        common.output_dir(config, "train_tiny"), config.name, model_config, params, meta, store_dtype=config.store_dtype
    )
    print(
        f"[{config.name}] done in {wall:.0f}s: train {final_train:.4f} eval {final_eval:.4f}; "
        f"wrote {npz} ({npz.stat().st_size / 1e6:.2f} MB), {js}",
        flush=True,
    )
    return {"npz": str(npz), "json": str(js), **meta}


def check(config) -> None:
    """Checks the settings before any work: the model config and the schedule."""
    LlamaConfig(**config.model.to_dict())
    for key in ("steps", "seq_len", "batch_size", "log_every", "eval_every", "eval_windows"):
        if isinstance(config[key], bool) or not isinstance(config[key], int) or config[key] < 1:
            raise ValueError(f"{key}={config[key]!r} must be an integer >= 1")
    if not 0 <= config.warmup_steps < config.steps:
        raise ValueError(f"warmup_steps={config.warmup_steps} must be in [0, steps={config.steps})")
    common.check_positive(learning_rate=config.learning_rate)


def main(config, plan):
    command = " ".join(["python -m experiments.train_tiny", *_flag_args()])
    train(config, command=command)


def _flag_args() -> list[str]:
    return [a for a in sys.argv[1:] if a.startswith("--config")]


if __name__ == "__main__":
    common.run("train_tiny", main, check, default_config=DEFAULT_CONFIG)
