"""Building blocks of the decoder: RMSNorm, rotary embeddings (RoPE), the SwiGLU MLP.

Dimension letters in einsum strings: T tokens, D d_model, F ffn_dim, N heads, H head_dim.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def _fan_in_init(in_axis, out_axis):
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
    )


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x**2) + eps) * scale``, computed in float32 (Llama convention)."""

    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> jax.Array:  # f32[head_dim // 2]
    """Inverse frequencies ``theta ** (-2i / head_dim)`` for ``i < head_dim // 2``."""
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(
    x: jax.Array,  # [..., T, N, H]
    positions: jax.Array,  # i32[..., T]
    *,
    theta: float,
) -> jax.Array:  # [..., T, N, H]
    """Rotates ``x`` by its positions, "rotate-half" layout (pairs ``(i, i + H/2)``, as HF Llama).

    Computed in float32 and cast back to ``x.dtype``.
    """
    head_dim = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(head_dim, theta)
    sin = jnp.sin(angles)[..., None, :]  # [..., T, 1, H/2]
    cos = jnp.cos(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : head_dim // 2], xf[..., head_dim // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    ffn_dim: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        d = x.shape[-1]
        w_gate = self.param("gate", _fan_in_init(0, 1), (d, self.ffn_dim), jnp.float32)
        w_up = self.param("up", _fan_in_init(0, 1), (d, self.ffn_dim), jnp.float32)
        w_down = self.param("down", _fan_in_init(0, 1), (self.ffn_dim, d), jnp.float32)
        x = x.astype(self.dtype)
        gate = jnp.einsum("...D,DF->...F", x, w_gate.astype(self.dtype))
        up = jnp.einsum("...D,DF->...F", x, w_up.astype(self.dtype))
        return jnp.einsum("...F,FD->...D", nn.silu(gate) * up, w_down.astype(self.dtype))
