"""TPU-style Pallas contiguous (GQA, optionally causal) flash attention.

Grid ``(batch, num_kv_heads, q_tiles, kv_tiles)``, the KV axis innermost and sequential: Pallas'
pipeline streams ``block_k`` keys per step into VMEM while the online-softmax state stays in VMEM
scratch. ``kv_lens`` is scalar-prefetched so the K/V index maps clamp to the last block a query tile
can see: steps past it re-use the resident block (no DMA) and skip compute. A tile holds
``block_q`` tokens times the ``G`` query heads of one KV head.

Constraints (ValueError): ``block_q * G`` and ``block_k`` multiples of 8 (16 for 16-bit dtypes),
``head_dim`` a multiple of 64. K/V are transposed to ``[B, Hkv, T, D]`` outside the kernel (one
copy) because Mosaic cannot tile a squeezed middle head axis. Compiled behaviour is unverified (no
TPU); TPU interpret mode is tested.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat, validation
from pallas_kernels.tiling import flash_layout, flash_untile, row_limit, tile_key_end
from pallas_kernels.tpu_common import VmemSoftmax, interpret_mode, scores, softmax_scratch


@dataclasses.dataclass(frozen=True)
class TpuFlashConfig:
    """Tuning knobs of the TPU-style flash kernel (block sizes are clipped to the padded lengths).

    Attributes:
      block_q: query tokens per tile.
      block_k: keys per pipeline step.
      strict_interpret: in interpret mode, detect races, raise on OOB reads, NaN-fill scratch.
    """

    block_q: int = 128
    block_k: int = 128
    strict_interpret: bool = True

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 8 or value % 8:
                raise ValueError(f"{name}={value!r} must be a positive multiple of 8")


def _kernel(
    kv_lens_ref,  # SMEM i32[B]
    q_ref,  # VMEM [block_q * G, D]
    k_ref,  # VMEM [block_k, D]
    v_ref,  # VMEM [block_k, D]
    o_ref,  # VMEM [block_q * G, D]
    m_ref,  # VMEM f32[block_q * G, 1]
    l_ref,
    acc_ref,  # VMEM f32[block_q * G, D]
    *,
    q_len: int,
    group: int,
    causal: bool,
    sm_scale: float,
    soft_cap: float | None,
):
    b, qi, kb = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    rows, _ = q_ref.shape
    block_q, block_k = rows // group, k_ref.shape[0]
    kv_len = kv_lens_ref[b]
    end = tile_key_end(kv_len, qi, block_q, q_len=q_len, causal=causal)
    state = VmemSoftmax(m_ref, l_ref, acc_ref)

    @pl.when(kb == 0)
    def _():
        state.reset()

    @pl.when(kb * block_k < end)
    def _():
        q = q_ref[...].astype(jnp.float32)
        k = k_ref[...].astype(jnp.float32)
        key_col = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        v = jnp.where(key_col < kv_len, v_ref[...].astype(jnp.float32), 0.0)
        key = kb * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        token = qi * block_q + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group
        limit = row_limit(kv_len, token, q_len=q_len, causal=causal)
        state.update(scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap), v, key < limit)

    @pl.when(kb == pl.num_programs(3) - 1)
    def _():
        state.store(o_ref)


def flash_attention(
    q, k, v, *, kv_lens=None, causal=True, sm_scale=1.0, soft_cap=None,
    config: TpuFlashConfig | None = None, interpret: bool = False,
):  # fmt: skip
    """TPU-style Pallas implementation of :func:`pallas_kernels.flash_attention` (same arguments;
    ``config`` defaults to :class:`TpuFlashConfig`, ``interpret`` runs TPU interpret mode)."""
    config = config or TpuFlashConfig()
    batch, q_len, kv_len, hq, hkv, d = validation.check_flash_attention(
        q, k, v, kv_lens, causal=causal, sm_scale=sm_scale, soft_cap=soft_cap
    )
    group = hq // hkv
    sub = 8 * (4 // jnp.dtype(q.dtype).itemsize)
    if d % 64:
        raise ValueError(f"head_dim={d} must be a multiple of 64 for the TPU-style kernel")
    block_q = min(config.block_q, -(-q_len // 8) * 8)
    block_k = min(config.block_k, -(-kv_len // sub) * sub)
    if (block_q * group) % sub or block_k % sub:
        raise ValueError(
            f"block_q * G={block_q * group} and block_k={block_k} must be multiples of {sub} "
            f"for {jnp.dtype(q.dtype).name}"
        )
    lens, q3, kt, vt = flash_layout(q, k, v, kv_lens, num_kv_heads=hkv, group_padded=group,
                                    block_q=block_q, block_k=block_k)  # fmt: skip
    rows = block_q * group
    nq, nk = q3.shape[2] // rows, kt.shape[2] // block_k

    def kv_index(b, h, qi, kb, lens_ref):
        end = tile_key_end(lens_ref[b], qi, block_q, q_len=q_len, causal=causal)
        return b, h, jnp.minimum(kb, jnp.maximum(pl.cdiv(end, block_k) - 1, 0)), 0

    q_spec = pl.BlockSpec((None, None, rows, d), lambda b, h, qi, kb, _: (b, h, qi, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, d), kv_index)
    kernel = functools.partial(
        _kernel, q_len=q_len, group=group, causal=causal, sm_scale=float(sm_scale),
        soft_cap=soft_cap,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, hkv, nq, nk),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=softmax_scratch(rows, d),
        ),
        out_shape=jax.ShapeDtypeStruct(q3.shape, q.dtype),
        compiler_params=compat.tpu_compiler_params(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret_mode(config, interpret),
        name="flash_attention_tpu",
    )(lens, q3, kt, vt)
    return flash_untile(out, q_len, group, group).reshape(q.shape)
