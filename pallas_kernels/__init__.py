"""Attention kernels over paged and contiguous KV, each with a float32 jnp reference.

Public ops (see :mod:`pallas_kernels.api` for the ``impl`` names)::

    import pallas_kernels as pk
    pk.paged_attention(q, k_pages, v_pages, lengths, page_indices, *, sm_scale, soft_cap, impl)
    pk.ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                              sm_scale, soft_cap, impl)
    pk.flash_attention(q, k, v, *, kv_lens, causal, sm_scale, soft_cap, impl)
    pk.cascade_paged_attention(q, k_pages, v_pages, lengths, page_indices, group_rows,
                               prefix_lens, *, sm_scale, soft_cap, impl)   # shared prefixes
"""

from pallas_kernels import reference, validation
from pallas_kernels.api import (
    IMPLS,
    cascade_paged_attention,
    flash_attention,
    paged_attention,
    ragged_paged_attention,
    resolve_impl,
)
from pallas_kernels.xla import XlaConfig

__all__ = [
    "IMPLS",
    "XlaConfig",
    "cascade_paged_attention",
    "flash_attention",
    "paged_attention",
    "ragged_paged_attention",
    "reference",
    "resolve_impl",
    "validation",
]
