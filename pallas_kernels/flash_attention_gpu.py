"""GPU-style Pallas contiguous (GQA, optionally causal) flash attention (Triton lowering).

Grid ``(batch, num_kv_heads, q_tiles)``; a program holds a ``block_q * Gp`` row tile (``Gp`` = query
heads per KV head rounded up to a power of two) and loops over ``block_k`` key blocks up to the last
key its rows may see, loading keys with a mask so positions at or past ``kv_lens[b]`` are never
read. Online softmax in registers.

Constraints (ValueError): ``head_dim`` a power of two >= 16; block sizes powers of two; the row tile
at least 16 rows (Triton ``dot``). K/V are transposed to ``[B, Hkv, T, D]`` outside the kernel.
Deprecated lowering (Mosaic GPU replaces Triton from JAX 0.11); compiled behaviour unverified here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, validation
from pallas_kernels.flash_attention_tpu import pad_axis, row_limit
from pallas_kernels.gpu_common import dot, next_pow2, online_update


@dataclasses.dataclass(frozen=True)
class GpuFlashConfig:
    """Tuning knobs of the GPU-style flash kernel.

    Attributes:
      block_q: query tokens per program (raised so a tile has >= 16 rows).
      block_k: keys per loop step (>= 16).
      num_warps, num_stages: Triton launch parameters.
    """

    block_q: int = 32
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value!r} must be a positive power of two")
        if self.block_k < 16:
            raise ValueError(f"block_k={self.block_k} must be >= 16")


def _kernel(
    kv_lens_ref,  # i32[B]
    q_ref,  # [block_q * Gp, D]
    k_ref,  # [Tk_pad, D]
    v_ref,  # [Tk_pad, D]
    o_ref,  # [block_q * Gp, D]
    *,
    block_k: int,
    q_len: int,
    group_padded: int,
    causal: bool,
    sm_scale: float,
    soft_cap: float | None,
):
    b, qi = pl.program_id(0), pl.program_id(2)
    q = q_ref[...]
    rows, head_dim = q.shape
    block_q = rows // group_padded
    kv_len = kv_lens_ref[b]
    token = qi * block_q + jnp.arange(rows) // group_padded
    limit = row_limit(kv_len, token, q_len=q_len, causal=causal)  # [rows]
    end = jnp.maximum(jnp.max(limit), 0)

    def body(i, carry):
        key = i * block_k + jnp.arange(block_k)
        mask = jnp.broadcast_to((key < kv_len)[:, None], (block_k, head_dim))
        k = compat.plgpu.load(k_ref.at[pl.ds(i * block_k, block_k), :], mask=mask, other=0.0)
        v = compat.plgpu.load(v_ref.at[pl.ds(i * block_k, block_k), :], mask=mask, other=0.0)
        s = dot(q, k.astype(q.dtype), trans_b=True) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        return online_update(carry, s, v.astype(q.dtype), key[None, :] < limit[:, None])

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    _, lsum, acc = lax.fori_loop(0, pl.cdiv(end, block_k), body, init)
    o_ref[...] = (acc / jnp.where(lsum == 0.0, 1.0, lsum)[:, None]).astype(o_ref.dtype)


def flash_attention(
    q: jax.Array,  # [B, Tq, Hq, D]
    k: jax.Array,  # [B, Tk, Hkv, D]
    v: jax.Array,  # [B, Tk, Hkv, D]
    *,
    kv_lens: jax.Array | None = None,  # i32[B]
    causal: bool = True,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    config: GpuFlashConfig | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, Tq, Hq, D]
    """GPU-style Pallas implementation of :func:`pallas_kernels.flash_attention`."""
    compat.require_triton()
    config = config or GpuFlashConfig()
    batch, q_len, kv_len, hq, hkv, d = validation.check_flash_attention(
        q, k, v, kv_lens, causal=causal, sm_scale=sm_scale, soft_cap=soft_cap
    )
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim={d} must be a power of two >= 16 for the GPU-style kernel")
    group = hq // hkv
    gp = next_pow2(group)
    block_q = max(min(config.block_q, next_pow2(q_len)), 16 // gp, 1)
    block_k = max(16, min(config.block_k, next_pow2(kv_len)))
    rows = block_q * gp
    lens = jnp.full((batch,), kv_len, jnp.int32) if kv_lens is None else kv_lens
    lens = jnp.minimum(jnp.asarray(lens, jnp.int32), kv_len)
    q5 = pad_axis(jnp.asarray(q), 1, block_q).reshape(batch, -1, hkv, group, d)
    q5 = jnp.pad(q5, ((0, 0), (0, 0), (0, 0), (0, gp - group), (0, 0)))
    q3 = q5.transpose(0, 2, 1, 3, 4).reshape(batch, hkv, -1, d)  # [B, Hkv, Tq_pad * Gp, D]
    kt = jnp.swapaxes(pad_axis(jnp.asarray(k), 1, block_k), 1, 2)  # [B, Hkv, Tk_pad, D]
    vt = jnp.swapaxes(pad_axis(jnp.asarray(v), 1, block_k), 1, 2)
    tile = pl.BlockSpec((None, None, rows, d), lambda b, h, qi: (b, h, qi, 0))
    kv_spec = pl.BlockSpec((None, None, kt.shape[2], d), lambda b, h, qi: (b, h, 0, 0))
    kernel = functools.partial(
        _kernel, block_k=block_k, q_len=q_len, group_padded=gp, causal=causal,
        sm_scale=float(sm_scale), soft_cap=soft_cap,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid=(batch, hkv, q3.shape[2] // rows),
        in_specs=[pl.BlockSpec((batch,), lambda b, h, qi: (0,)), tile, kv_spec, kv_spec],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(q3.shape, q.dtype),
        compiler_params=compat.gpu_compiler_params(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="flash_attention_gpu",
    )(lens, q3, kt, vt)
    out = out.reshape(batch, hkv, -1, gp, d)[:, :, :q_len, :group].transpose(0, 2, 1, 3, 4)
    return out.reshape(q.shape)
