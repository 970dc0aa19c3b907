"""The KV-policy interface: a policy scores, the engine decides.

A policy sees one sequence's keys per layer and KV head (stored after RoPE, so each key already
carries its position), each slot's original position and, for a policy with a ``mass_window``,
each slot's accumulated attention mass (`paged.kv.mass`), and returns a score per slot; the
engine keeps the ``keep_count`` highest-scoring slots of every (layer, KV head), compacts them
into the sequence's first pages and frees the rest (``paged.kv.blocks.compact``,
``paged.engine.kv_compact``). Scoring runs inside the jitted compaction on device: it is written
against an array namespace ``xp`` (``jax.numpy`` there, ``numpy`` in tests), so a policy file
imports no JAX and the host never reads KV back.
"""

from __future__ import annotations

from paged.config.kv_policy import KVPolicyConfig


class KVPolicy:
    """One eviction method (subclass it in one file and register it in ``POLICIES``).

    Args:
      config: the method's settings (budget, interval, its own parameters).
    """

    name = "base"
    # Which queries' attention mass the engine accumulates for ``scores(mass=...)``: None (the
    # policy needs none: no mass is computed), 0 (every query of every step: H2O), or w > 0 (a
    # prompt's last w queries: SnapKV's observation window).
    mass_window: int | None = None
    per_layer = False  # ``layer_keep`` may differ between layers (then holes are passed)

    def __init__(self, config: KVPolicyConfig):
        self.config = config

    # A policy is a static argument of the jitted compaction (`paged.engine.kv_compact`), cached
    # by equality: two policies of one class and equal settings score alike, so engines built
    # with equal configs share its compilations (by identity, every engine compiled its own).
    def __eq__(self, other) -> bool:
        return isinstance(other, KVPolicy) and _key(self) == _key(other)

    def __hash__(self) -> int:
        return hash(_key(self))

    def keep_count(self, num_tokens: int) -> int:
        """Tokens kept per (layer, KV head) of a sequence holding ``num_tokens`` (host side; the
        engine drops nothing when this is ``num_tokens``)."""
        return self.config.keep_count(num_tokens)

    def layer_keep(self, num_tokens: int, num_layers: int) -> list[int]:
        """Tokens kept per layer (host side): ``keep_count`` in every layer unless the method
        budgets layers apart (PyramidKV). The pages freed are those of the largest; a layer that
        keeps fewer hides its other slots (docs/kv-policies.md)."""
        return [self.keep_count(num_tokens)] * num_layers

    def scores(self, xp, keys, positions, valid, mass=None):
        """Per-slot scores (higher: kept first); ties go to the earlier slot.

        Args:
          xp: the array namespace (``jax.numpy`` in the engine, ``numpy`` in references).
          keys: f32[L, Hkv, R, D], the sequence's slots (padded to R), after RoPE.
          positions: i32[L, Hkv, R], each slot's original position (RoPE position).
          valid: bool[R], the real slots (padding scores are ignored).
          mass: f32[L, Hkv, R], each slot's accumulated attention mass (``mass_window`` not
            None), else None.

        Returns:
          f32[L, Hkv, R].
        """
        raise NotImplementedError


def _key(policy: KVPolicy) -> tuple:
    """What a policy's scores depend on: its class and settings, with the settings' types
    (``budget=1``, one token, equals ``budget=1.0``, every token, as numbers)."""
    c = policy.config
    return type(policy), c, type(c.budget), type(c.recent_tokens)


__all__ = ["KVPolicy"]
