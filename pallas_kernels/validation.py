"""Static (trace-time) shape and dtype checks shared by every kernel and its reference.

Each public op calls exactly one ``check_*`` function here before dispatching, so the reference, the
XLA path and the Pallas kernels reject the same inputs with the same messages. Only static facts are
checked (shapes, dtypes, Python knobs); values inside traced arrays (lengths, page ids) cannot be.
Backend-specific limits (block sizes a kernel can tile) live with each kernel's config.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import packed, quant

#: Input dtypes every implementation accepts; accumulation is always float32.
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class PagedShape:
    """Static sizes of a paged-attention call, named once."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    total_num_pages: int
    page_size: int
    pages_per_seq: int

    @property
    def group(self) -> int:
        """Query heads per KV head (1 = MHA, num_q_heads = MQA)."""
        return self.num_q_heads // self.num_kv_heads


_REAL = (int, float, np.integer, np.floating)


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(x))


def _check_float(name: str, x) -> None:
    dtype = jnp.result_type(x)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}.dtype={dtype} must be one of float32, bfloat16, float16")


def _check_int(name: str, x) -> None:
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name}.dtype={dtype} must be an integer type (int32)")


def check_knobs(*, sm_scale, soft_cap) -> None:
    """Checks the numeric keyword arguments every attention op takes."""
    if not isinstance(sm_scale, _REAL) or isinstance(sm_scale, bool):
        raise TypeError(f"{sm_scale=} must be a Python float")
    if not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"{sm_scale=} must be a finite positive number")
    if soft_cap is not None:
        if not isinstance(soft_cap, _REAL) or isinstance(soft_cap, bool):
            raise TypeError(f"{soft_cap=} must be None or a Python float")
        if not np.isfinite(soft_cap) or soft_cap <= 0:
            raise ValueError(f"{soft_cap=} must be None or a finite positive number")


def _check_quantized(k_pages, v_pages) -> bool:
    """Checks quantized pages (values int8 / fp8, float32 scales ``[..., P, S]`` with S = page or
    1, the same layout for K and V); returns whether the pages are quantized."""
    if any(isinstance(x, packed.PackedPages) for x in (k_pages, v_pages)):
        raise ValueError("int4/int2 (KIVI) PackedPages are read by pallas_kernels.kivi."
                         "paged_attention / ragged_paged_attention (closed pages plus the open "
                         "page; every impl style), not by this op")
    kq, vq = (isinstance(x, quant.QuantizedPages) for x in (k_pages, v_pages))
    if kq != vq:
        raise TypeError(f"k_pages and v_pages must both be QuantizedPages or both arrays, got "
                        f"{type(k_pages).__name__} and {type(v_pages).__name__}")
    if not kq:
        return False
    allowed = [quant.storage_dtype(name) for name in quant.QUANT_DTYPES]
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if jnp.dtype(x.values.dtype) not in allowed:
            raise TypeError(f"{name}.values.dtype={x.values.dtype} must be one of "
                            f"{[d.name for d in allowed]}")
        if jnp.dtype(x.scales.dtype) != jnp.dtype(quant.SCALE_DTYPE):
            raise TypeError(f"{name}.scales.dtype={x.scales.dtype} must be float32")
        vshape, sshape = _shape(x.values), _shape(x.scales)
        if len(vshape) < 2 or sshape[:-1] != vshape[:-2] or sshape[-1] not in (1, vshape[-2]):
            raise ValueError(f"{name}.scales.shape={sshape} must be values.shape[:-2] + (S,) with "
                             f"S = page_size or 1 (values.shape={vshape})")
    if _shape(k_pages.scales) != _shape(v_pages.scales):
        raise ValueError(f"v_pages.scales.shape={_shape(v_pages.scales)} must equal "
                         f"k_pages.scales.shape={_shape(k_pages.scales)}")
    return True


def check_sliding_window(sliding_window) -> None:
    """``sliding_window`` is None (full causal attention) or a positive Python int W: a query at
    position p sees keys ``[p - W + 1, p]`` only."""
    if sliding_window is None:
        return
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)):
        raise TypeError(f"{sliding_window=} must be None or a positive int")
    if sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be None or a positive int")


def _check_pages(q_heads: int, q_dim: int, q_dtype, k_pages, v_pages) -> tuple[int, int, int]:
    if _check_quantized(k_pages, v_pages):
        # Quantized values: any float query (it is never quantized); the values' dtypes and
        # the scales were checked above.
        k_pages, v_pages = k_pages.values, v_pages.values
        q_dtype = jnp.result_type(k_pages)
    else:
        _check_float("k_pages", k_pages)
        _check_float("v_pages", v_pages)
    k_shape, v_shape = _shape(k_pages), _shape(v_pages)
    if len(k_shape) != 4:
        raise ValueError(
            f"k_pages.shape={k_shape} must be [num_kv_heads, num_pages, page_size, head_dim]"
        )
    if k_shape != v_shape:
        raise ValueError(f"v_pages.shape={v_shape} must equal k_pages.shape={k_shape}")
    if jnp.result_type(k_pages) != jnp.result_type(v_pages):
        raise TypeError(
            f"v_pages.dtype={jnp.result_type(v_pages)} must equal "
            f"k_pages.dtype={jnp.result_type(k_pages)}"
        )
    if jnp.result_type(k_pages) != jnp.dtype(q_dtype):
        raise TypeError(
            f"k_pages.dtype={jnp.result_type(k_pages)} must equal q.dtype={jnp.dtype(q_dtype)}"
        )
    num_kv_heads, num_pages, page_size, head_dim = k_shape
    if head_dim != q_dim:
        raise ValueError(f"k_pages head_dim={head_dim} must equal q head_dim={q_dim}")
    if num_kv_heads < 1 or q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={q_heads} must be a multiple of {num_kv_heads=}")
    if num_pages < 1 or page_size < 1 or head_dim < 1:
        raise ValueError(f"k_pages.shape={k_shape} must have positive sizes")
    return num_kv_heads, num_pages, page_size


def _check_q_and_pages(q, k_pages, v_pages, rows_name: str) -> tuple[int, ...]:
    """Checks ``q`` [rows, Hq, D] and its pages; returns ``(rows, Hq, D, Hkv, P, page)``."""
    _check_float("q", q)
    q_shape = _shape(q)
    if len(q_shape) != 3:
        raise ValueError(f"q.shape={q_shape} must be [{rows_name}, num_q_heads, head_dim]")
    rows, num_q_heads, head_dim = q_shape
    pages = _check_pages(num_q_heads, head_dim, jnp.result_type(q), k_pages, v_pages)
    return (rows, num_q_heads, head_dim, *pages)


def _check_table(page_indices, rows: int, rows_name: str) -> int:
    _check_int("page_indices", page_indices)
    shape = _shape(page_indices)
    if len(shape) != 2 or shape[0] != rows:
        raise ValueError(f"page_indices.shape={shape} must be [{rows_name}={rows}, pages_per_seq]")
    pages_per_seq = shape[1]
    if pages_per_seq < 1:
        raise ValueError(f"{pages_per_seq=} must be >= 1")
    return pages_per_seq


def check_paged_attention(q, k_pages, v_pages, lengths, page_indices, *, sm_scale, soft_cap):
    """Validates ``paged_attention`` inputs; returns their :class:`PagedShape`."""
    batch, num_q_heads, head_dim, num_kv_heads, num_pages, page_size = _check_q_and_pages(
        q, k_pages, v_pages, "batch"
    )
    _check_int("lengths", lengths)
    if _shape(lengths) != (batch,):
        raise ValueError(f"lengths.shape={_shape(lengths)} must be [batch={batch}]")
    pages_per_seq = _check_table(page_indices, batch, "batch")
    check_knobs(sm_scale=sm_scale, soft_cap=soft_cap)
    return PagedShape(num_q_heads, num_kv_heads, head_dim, num_pages, page_size, pages_per_seq)


def check_cascade_paged_attention(q, k_pages, v_pages, lengths, page_indices, group_rows,
                                  prefix_lens, *, sm_scale, soft_cap):  # fmt: skip
    """Validates ``cascade_paged_attention`` inputs; returns ``(PagedShape, num_groups,
    group_size)``."""
    shp = check_paged_attention(
        q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale, soft_cap=soft_cap
    )
    _check_int("group_rows", group_rows)
    _check_int("prefix_lens", prefix_lens)
    shape = _shape(group_rows)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"group_rows.shape={shape} must be [num_groups >= 1, group_size >= 1]")
    if _shape(prefix_lens) != (shape[0],):
        raise ValueError(f"prefix_lens.shape={_shape(prefix_lens)} must be [num_groups={shape[0]}]")
    return shp, shape[0], shape[1]


def check_ragged_paged_attention(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, soft_cap
):
    """Validates ``ragged_paged_attention`` inputs; returns their :class:`PagedShape`."""
    _, num_q_heads, head_dim, num_kv_heads, num_pages, page_size = _check_q_and_pages(
        q, k_pages, v_pages, "num_tokens"
    )
    _check_int("kv_lens", kv_lens)
    kv_shape = _shape(kv_lens)
    if len(kv_shape) != 1 or kv_shape[0] < 1:
        raise ValueError(f"kv_lens.shape={kv_shape} must be [max_num_seqs]")
    max_num_seqs = kv_shape[0]
    pages_per_seq = _check_table(page_indices, max_num_seqs, "max_num_seqs")
    _check_int("cu_q_lens", cu_q_lens)
    if _shape(cu_q_lens) != (max_num_seqs + 1,):
        raise ValueError(
            f"cu_q_lens.shape={_shape(cu_q_lens)} must be [max_num_seqs + 1={max_num_seqs + 1}]"
        )
    if isinstance(num_seqs, (bool, float)):
        raise TypeError(f"{num_seqs=} must be an int or an i32[1] array")
    if isinstance(num_seqs, int):
        if not 0 <= num_seqs <= max_num_seqs:
            raise ValueError(f"{num_seqs=} must be in [0, {max_num_seqs=}]")
    else:
        _check_int("num_seqs", num_seqs)
        if _shape(num_seqs) not in ((1,), ()):
            raise ValueError(f"num_seqs.shape={_shape(num_seqs)} must be [1]")
    check_knobs(sm_scale=sm_scale, soft_cap=soft_cap)
    return PagedShape(num_q_heads, num_kv_heads, head_dim, num_pages, page_size, pages_per_seq)


def check_flash_attention(q, k, v, kv_lens, *, causal, sm_scale, soft_cap):
    """Validates ``flash_attention`` inputs; returns ``(batch, q_len, kv_len, hq, hkv, head_dim)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(name, x)
        if len(_shape(x)) != 4:
            raise ValueError(
                f"{name}.shape={_shape(x)} must be [batch, seq_len, num_heads, head_dim]"
            )
    batch, q_len, num_q_heads, head_dim = _shape(q)
    if _shape(k) != _shape(v):
        raise ValueError(f"v.shape={_shape(v)} must equal k.shape={_shape(k)}")
    kb, kv_len, num_kv_heads, kd = _shape(k)
    if kb != batch:
        raise ValueError(f"k.shape={_shape(k)} batch must equal q batch={batch}")
    if kd != head_dim:
        raise ValueError(f"k head_dim={kd} must equal q head_dim={head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of {num_kv_heads=}")
    if not (jnp.result_type(q) == jnp.result_type(k) == jnp.result_type(v)):
        raise TypeError(
            f"q, k, v dtypes must match, got {jnp.result_type(q)}, {jnp.result_type(k)}, "
            f"{jnp.result_type(v)}"
        )
    if min(batch, q_len, kv_len, head_dim) < 1:
        raise ValueError(f"q.shape={_shape(q)} and k.shape={_shape(k)} must have positive sizes")
    if kv_lens is not None:
        _check_int("kv_lens", kv_lens)
        if _shape(kv_lens) != (batch,):
            raise ValueError(f"kv_lens.shape={_shape(kv_lens)} must be [batch={batch}]")
    if not isinstance(causal, bool):
        raise TypeError(f"{causal=} must be a bool")
    check_knobs(sm_scale=sm_scale, soft_cap=soft_cap)
    return batch, q_len, kv_len, num_q_heads, num_kv_heads, head_dim


def layer_view(k_pages, v_pages, layer):
    """Stand-ins of one layer's pages for the checks above when the pages are the stacked cache.

    With ``layer=None`` the pages are returned unchanged. Otherwise both must be
    ``[L, Hkv, P, page, D]`` and the result is ``jax.ShapeDtypeStruct``s of ``[Hkv, P, page, D]``.

    Raises:
      ValueError: not 5-D, or a static ``layer`` outside ``[0, L)``.
    """
    if layer is None:
        return k_pages, v_pages
    out = []
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if isinstance(x, quant.QuantizedPages):
            values = layer_view(x.values, x.values, layer)[0]
            scales = jax.ShapeDtypeStruct(_shape(x.scales)[1:], x.scales.dtype)
            out.append(quant.QuantizedPages(values, scales))
            continue
        shape = _shape(x)
        if len(shape) != 5:
            raise ValueError(f"with layer={layer!r}, {name} must be the stacked cache "
                             f"[L, Hkv, P, page, D], got shape {shape}")
        if isinstance(layer, (int, np.integer)) and not 0 <= layer < shape[0]:
            raise ValueError(f"layer={layer} must be in [0, {shape[0]})")
        out.append(jax.ShapeDtypeStruct(shape[1:], x.dtype))
    return tuple(out)
