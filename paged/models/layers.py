"""Building blocks of the decoder: RMSNorm, rotary embeddings (RoPE), the SwiGLU MLP.

Dimension letters in einsum strings: T tokens, D d_model, F ffn_dim, N heads, H head_dim.
"""

from __future__ import annotations

import math

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


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: str = "none",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_len: int = 8192,
) -> jax.Array:  # f32[head_dim // 2]
    """Inverse frequencies ``theta ** (-2i / head_dim)`` for ``i < head_dim // 2``, rescaled.

    ``scaling`` follows Hugging Face's RoPE types: "none"; "linear" divides every frequency by
    ``factor`` (the same as dividing positions by it); "llama3" divides the frequencies whose
    wavelength ``2 pi / f`` exceeds ``original_max_len / low_freq_factor`` by ``factor``, keeps
    those with a wavelength below ``original_max_len / high_freq_factor``, and interpolates
    ``(1 - s) f / factor + s f`` with ``s = (original_max_len / wavelength - low_freq_factor) /
    (high_freq_factor - low_freq_factor)`` in between. Computed in float32, in the order Hugging
    Face's ``rope_init_fn``s use.
    """
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling == "linear":
        inv = inv / factor
    elif scaling == "llama3":
        low_wavelen = original_max_len / low_freq_factor
        high_wavelen = original_max_len / high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = jnp.where(medium, smoothed, scaled)
    elif scaling != "none":
        raise ValueError(f"rope scaling {scaling!r} must be 'none', 'linear' or 'llama3'")
    return inv


def apply_rope(
    x: jax.Array,  # [..., T, N, H]
    positions: jax.Array,  # i32[..., T]
    *,
    theta: float = 10000.0,
    rope: tuple | None = None,
) -> jax.Array:  # [..., T, N, H]
    """Rotates ``x`` by its positions, "rotate-half" layout (pairs ``(i, i + H/2)``, as HF Llama).

    Args:
      x: queries or keys.
      positions: each row's position.
      theta: RoPE base (unscaled RoPE).
      rope: ``LlamaConfig.rope``, ``(theta, scaling, factor, low_freq_factor, high_freq_factor,
        original_max_len)``; replaces ``theta`` when given (see `rope_inv_freq`).

    Computed in float32 and cast back to ``x.dtype``.
    """
    head_dim = x.shape[-1]
    inv_freq = rope_inv_freq(head_dim, *(rope if rope is not None else (theta,)))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
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
