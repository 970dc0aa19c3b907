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

from pallas_kernels import compat, gpu_common, softmax, validation
from pallas_kernels.gpu_common import next_pow2, online_update, scores
from pallas_kernels.tiling import flash_layout, flash_untile, row_limit


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
        s = scores(q, k.astype(q.dtype), sm_scale=sm_scale, soft_cap=soft_cap)
        return online_update(carry, s, v.astype(q.dtype), key[None, :] < limit[:, None])

    init = softmax.initial_state((rows,), head_dim)
    _, lsum, acc = lax.fori_loop(0, pl.cdiv(end, block_k), body, init)
    o_ref[...] = softmax.normalize(lsum, acc).astype(o_ref.dtype)


def flash_attention(
    q, k, v, *, kv_lens=None, causal=True, sm_scale=1.0, soft_cap=None,
    config: GpuFlashConfig | None = None, interpret: bool = False,
):  # fmt: skip
    """GPU-style Pallas implementation of :func:`pallas_kernels.flash_attention` (same arguments;
    ``config`` defaults to :class:`GpuFlashConfig`, ``interpret=True`` runs on CPU)."""
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
    lens, q3, kt, vt = flash_layout(q, k, v, kv_lens, num_kv_heads=hkv, group_padded=gp,
                                    block_q=block_q, block_k=block_k)  # fmt: skip
    tile = pl.BlockSpec((None, None, rows, d), lambda b, h, qi: (b, h, qi, 0))
    kv_spec = pl.BlockSpec((None, None, kt.shape[2], d), lambda b, h, qi: (b, h, 0, 0))
    kernel = functools.partial(
        _kernel, block_k=block_k, q_len=q_len, group_padded=gp, causal=causal,
        sm_scale=float(sm_scale), soft_cap=soft_cap,
    )  # fmt: skip
    out = gpu_common.pallas_call(
        kernel,
        grid=(batch, hkv, q3.shape[2] // rows),
        in_specs=[pl.BlockSpec((batch,), lambda b, h, qi: (0,)), tile, kv_spec, kv_spec],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(q3.shape, q.dtype),
        config=config,
        interpret=interpret,
        name="flash_attention_gpu",
    )(lens, q3, kt, vt)
    return flash_untile(out, q_len, group, gp).reshape(q.shape)
