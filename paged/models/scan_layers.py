"""Stacked layer params: one pytree with a leading layer axis instead of ``layers_{i}``.

`Llama` runs a model whose params hold ``layers`` (every decoder block's params stacked on axis
0) with one ``jax.lax.scan`` over the layers, so XLA compiles one block instead of
``num_layers`` copies: compile time stays flat in depth (a 30-layer model compiles about as fast
as a 4-layer one). Only a model whose layers are all alike (one sliding window, or none) can be
stacked. `stack_layers` / `unstack_layers` convert between the two layouts on the host (numpy);
loaders produce ``layers_{i}`` (the layout of checkpoints and `init_params`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paged.models.config import LlamaConfig

STACKED = "layers"

Params = dict[str, Any]


def can_stack(config: LlamaConfig) -> bool:
    """True if every layer has the same attention kind (one scan body serves them all)."""
    return len(set(config.layer_windows)) == 1


def is_stacked(params: Params) -> bool:
    return STACKED in params.get("params", {})


def _tree_stack(trees: list) -> Any:
    first = trees[0]
    if isinstance(first, dict):
        return {k: _tree_stack([t[k] for t in trees]) for k in first}
    return np.stack([np.asarray(t) for t in trees])


def _tree_index(tree: Any, i: int) -> Any:
    if isinstance(tree, dict):
        return {k: _tree_index(v, i) for k, v in tree.items()}
    return tree[i]


def stack_layers(config: LlamaConfig, params: Params) -> Params:
    """``params`` with ``layers_0 ... layers_{L-1}`` replaced by ``layers`` (stacked, numpy).

    Raises:
      ValueError: the layers differ in kind (`can_stack`), or a layer is missing.
    """
    if not can_stack(config):
        raise ValueError(f"cannot stack layers of different kinds: {config.layer_windows}")
    inner = dict(params["params"])
    names = [f"layers_{i}" for i in range(config.num_layers)]
    missing = [n for n in names if n not in inner]
    if missing:
        raise ValueError(f"params have no {missing[0]!r}")
    inner[STACKED] = _tree_stack([inner.pop(n) for n in names])
    return {**params, "params": inner}


def unstack_layers(config: LlamaConfig, params: Params) -> Params:
    """The inverse of `stack_layers` (``layers`` split into ``layers_{i}``)."""
    inner = dict(params["params"])
    stacked = inner.pop(STACKED)
    for i in range(config.num_layers):
        inner[f"layers_{i}"] = _tree_index(stacked, i)
    return {**params, "params": inner}
