"""Public attention ops and the one dispatcher that maps ``impl`` to an implementation.

``impl`` names (the same for every op):

==================  ==========================================================================
``"auto"``          by backend: cpu -> ``"xla"``, gpu -> ``"pallas_gpu"``, tpu -> ``"pallas_tpu"``;
                    the paged ops fall back to ``"xla"`` for shapes that kernel cannot tile
                    (e.g. ``head_dim`` 80 or 24, see `auto_fits`)
``"xla"``           blocked online-softmax in jnp (:mod:`pallas_kernels.xla`); fast on CPU
``"reference"``     the plain float32 references (:mod:`pallas_kernels.reference`); tests only
``"pallas"``        the Pallas kernel compiled for the current backend (gpu or tpu)
``"pallas_tpu"``    TPU-style kernel (Mosaic; scalar prefetch + manual DMA), compiled
``"pallas_gpu"``    GPU-style kernel (Triton lowering; split-K flash-decoding), compiled
``"interpret"``     same as ``"interpret_tpu"``
``"interpret_tpu"`` TPU-style kernel in TPU interpret mode (runs on CPU; checks DMA races/OOB)
``"interpret_gpu"`` GPU-style kernel with ``interpret=True`` (runs on CPU)
==================  ==========================================================================

``config`` takes the chosen implementation's tuning dataclass: :class:`pallas_kernels.XlaConfig`,
``pallas_kernels.tpu_common.TpuPagedConfig`` / ``gpu_common.GpuPagedConfig`` (paged and ragged),
``flash_attention_tpu.TpuFlashConfig`` / ``flash_attention_gpu.GpuFlashConfig`` (flash); None
means its defaults. Backend constraints (page size, head_dim, VMEM) are in those modules and raise
ValueError naming the value.

The GPU-style kernels use Pallas' Triton lowering, which newer JAX deprecates in favour of Mosaic
GPU; nothing outside this module names them, so they can be swapped without touching callers.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from pallas_kernels import cascade, reference, validation, xla

IMPLS = (
    "auto", "xla", "reference", "pallas", "pallas_tpu", "pallas_gpu",
    "interpret", "interpret_tpu", "interpret_gpu",
)  # fmt: skip

# op name -> (module, function) per kernel style; imported lazily so the XLA path never pays for
# Pallas imports (and a JAX without one of the lowerings still serves the others).
_KERNELS = {
    "paged_attention": {
        "tpu": ("pallas_kernels.paged_attention_tpu", "paged_attention"),
        "gpu": ("pallas_kernels.paged_attention_gpu", "paged_attention"),
    },
    "ragged_paged_attention": {
        "tpu": ("pallas_kernels.ragged_attention_tpu", "ragged_paged_attention"),
        "gpu": ("pallas_kernels.ragged_attention_gpu", "ragged_paged_attention"),
    },
    "paged_attention_state": {
        "tpu": ("pallas_kernels.paged_attention_tpu", "paged_attention_state"),
        "gpu": ("pallas_kernels.paged_attention_gpu", "paged_attention_state"),
    },
    "flash_attention": {
        "tpu": ("pallas_kernels.flash_attention_tpu", "flash_attention"),
        "gpu": ("pallas_kernels.flash_attention_gpu", "flash_attention"),
    },
}


def resolve_impl(impl: str, backend: str | None = None) -> tuple[str, str | None, bool]:
    """Maps an ``impl`` name to ``(kind, style, interpret)``.

    ``kind`` is ``"xla"``, ``"reference"`` or ``"pallas"``; ``style`` is ``"tpu"`` / ``"gpu"`` for
    Pallas kernels (else None); ``interpret`` says whether the kernel runs in interpret mode.

    Raises:
      ValueError: unknown ``impl``, or ``"pallas"`` on a backend without a compiled kernel.
    """
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")
    backend = backend or jax.default_backend()
    if impl == "auto":
        impl = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "xla")
    if impl in ("xla", "reference"):
        return impl, None, False
    if impl == "pallas":
        if backend not in ("gpu", "tpu"):
            raise ValueError(
                f"{impl=} compiles a kernel for gpu or tpu, but the backend is {backend!r}; "
                "use impl='interpret_tpu' or 'interpret_gpu' to run a kernel on CPU"
            )
        return "pallas", backend, False
    if impl == "interpret":
        impl = "interpret_tpu"
    kind, style = impl.split("_")
    return "pallas", style, kind == "interpret"


def auto_fits(style: str, shp: validation.PagedShape, dtype, config=None) -> bool:
    """Whether the ``style`` ("gpu" / "tpu") paged kernels can tile ``shp``; when they cannot,
    ``impl="auto"`` serves the call with the XLA path instead of raising (an explicit Pallas impl
    still raises, naming the value)."""
    try:
        if style == "gpu":
            from pallas_kernels import gpu_common

            if not isinstance(config, gpu_common.GpuPagedConfig):
                config = gpu_common.GpuPagedConfig()
            gpu_common.check_gpu_constraints(shp, config)
        else:
            from pallas_kernels import tpu_common

            if not isinstance(config, tpu_common.TpuPagedConfig):
                config = tpu_common.TpuPagedConfig()
            tpu_common.check_tpu_constraints(shp, dtype, config)
    except ValueError:
        return False
    return True


MASS = """The attention mass (``mass_weight``, KV policies such as H2O and SnapKV): per
sequence, KV head and key slot (in table order, ``j`` at page ``page_indices[.., j // page]``),
the sum over the call's query rows ``t`` of that sequence and the query heads of the KV head's
group of ``mass_weight[t]`` x the softmax probability of the key (0 for slots no query sees). The
"xla" path reads the keys a second time (the probabilities need each query's final max and sum:
keys only, about the score half of the attention's work); "reference" materialises them. The
Pallas styles do not return it: their one pass keeps only the running max and sum per query
(split-K partitions merged after the kernel on GPU), so the mass would be a second kernel over
the same pages (computed separately it costs one more ``q . k`` pass over every key a query
sees, the K pages read again, no V). Without ``mass_weight`` every path is unchanged."""


def _check_mass(kind: str, weight, rows: int) -> None:
    if kind == "pallas":
        raise ValueError("mass_weight: the Pallas kernels do not return the attention mass "
                         "(pallas_kernels.api.MASS); use impl='xla' or 'reference'")
    if getattr(weight, "shape", None) != (rows,):
        raise ValueError(f"mass_weight must be f32[{rows}] (one weight per query row), got "
                         f"shape {getattr(weight, 'shape', None)}")


def _kernel(op: str, style: str):
    module, name = _KERNELS[op][style]
    return getattr(importlib.import_module(module), name)


def paged_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, page, D]
    v_pages: jax.Array,  # [Hkv, P, page, D]
    lengths: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    *,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    impl: str = "auto",
    config=None,
    layer=None,
    sliding_window: int | None = None,
    mass_weight: jax.Array | None = None,  # f32[B]
) -> jax.Array:  # [B, Hq, D]
    """Decode attention: one query token per sequence over its paged KV cache.

    Sequence ``b`` owns keys ``0 .. lengths[b]-1``, key ``j`` stored at page
    ``page_indices[b, j // page]``, offset ``j % page``. Positions ``>= lengths[b]`` are never read
    (their contents, NaN included, do not matter); ``lengths[b] == 0`` gives zeros. Jittable with
    traced ``lengths`` and ``page_indices``.

    Args:
      q: queries, float32 / bfloat16 / float16; ``Hq`` a multiple of ``Hkv`` (GQA, MQA, MHA).
      k_pages: key pages, same dtype as ``q``.
      v_pages: value pages, same shape and dtype as ``k_pages``.
      lengths: number of valid keys per sequence, in ``[0, pages_per_seq * page]``.
      page_indices: physical page of each logical page; entries past a sequence's length are unused.
      sm_scale: multiplies ``q . k`` before the soft cap and softmax.
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      impl: implementation name, see :mod:`pallas_kernels.api`.
      config: optional tuning dataclass of the chosen implementation (e.g. ``XlaConfig``).
      sliding_window: if set (a positive int W), the query at position ``lengths[b] - 1`` sees
        only keys ``[lengths[b] - W, lengths[b])``; pages wholly behind the window are not read
        (every implementation starts its page loop at the page holding key ``lengths[b] - W``),
        so their table entries may be anything that is in bounds (a recycled block, the null page).
      layer: if given, ``k_pages``/``v_pages`` are the stacked cache ``[L, Hkv, P, page, D]`` and
        layer ``layer`` is read. The "xla" impl gathers straight from the stacked array: slicing a
        layer out of a donated stacked cache inside a jitted step makes XLA copy the whole layer
        on every call (measured: the step time then grows with the pool size). Pallas impls take
        the slice.

      mass_weight: if given (f32[B], a weight per query token), also return the attention
        mass (see :data:`MASS`).

    Returns:
      ``[B, Hq, D]`` in ``q.dtype``, accumulated in float32; with ``mass_weight``
      ``(out, mass f32[B, Hkv, pages_per_seq * page])``.

    Raises:
      ValueError / TypeError: bad shapes, dtypes, knobs or ``impl`` (message names the value).
    """
    shp = validation.check_paged_attention(
        q, *validation.layer_view(k_pages, v_pages, layer), lengths, page_indices,
        sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    kind, style, interpret = resolve_impl(impl)
    if impl == "auto" and kind == "pallas" and not auto_fits(style, shp, q.dtype, config):
        kind, config = "xla", None
    validation.check_sliding_window(sliding_window)
    kw = {"sm_scale": sm_scale, "soft_cap": soft_cap, "sliding_window": sliding_window}
    if mass_weight is not None:
        if impl == "auto":  # the Pallas styles do not return the mass (MASS)
            kind, config = "xla", None
        _check_mass(kind, mass_weight, q.shape[0])
        kw["mass_weight"] = mass_weight
    if kind == "xla":
        return xla.paged_attention(q, k_pages, v_pages, lengths, page_indices, **kw, config=config,
                                   layer=layer)
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    args = (q, k_pages, v_pages, lengths, page_indices)
    if kind == "reference":
        return reference.paged_attention(*args, **kw)
    return _kernel("paged_attention", style)(*args, **kw, config=config, interpret=interpret)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, page, D]
    v_pages: jax.Array,  # [Hkv, P, page, D]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1] | int
    *,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    impl: str = "auto",
    config=None,
    layer=None,
    sliding_window: int | None = None,
    mass_weight: jax.Array | None = None,  # f32[T]
    kv_holes: jax.Array | None = None,  # i32[max_num_seqs, 2]
) -> jax.Array:  # [T, Hq, D]
    """Causal attention for a mixed batch: prefill chunks, decodes and multi-token verification.

    Sequence ``i < num_seqs`` owns query rows ``cu_q_lens[i]:cu_q_lens[i+1]``: the last
    ``q_len_i`` of its ``kv_lens[i]`` tokens, whose KV is already in the pages. Row ``t`` of sequence
    ``i`` sits at position ``kv_lens[i] - q_len_i + (t - cu_q_lens[i])`` and sees keys up to and
    including that position. Rows at or past ``cu_q_lens[num_seqs]`` are padding and give zeros;
    sequence slots ``>= num_seqs`` are ignored. ``cu_q_lens`` must be non-decreasing from 0 (not
    checked: it is traced). Jittable with all integer inputs traced.

    Args:
      q: query rows of all sequences, back to back, then padding.
      k_pages: key pages; v_pages: value pages (as in :func:`paged_attention`).
      kv_lens: tokens in the cache per sequence slot (including this step's queries).
      page_indices: page table per sequence slot.
      cu_q_lens: cumulative query lengths, ``cu_q_lens[0] == 0``.
      num_seqs: number of live sequence slots, an ``i32[1]`` array or a Python int.
      sm_scale, soft_cap, impl, config, layer: as in :func:`paged_attention`.
      sliding_window: if set (a positive int W), the row at position ``p`` sees keys
        ``[p - W + 1, p]`` only; pages wholly behind every row's window are not read.
      mass_weight: if given (f32[T], a weight per query row), also return the attention mass
        (see :data:`MASS`), summed over each sequence's rows.
      kv_holes: if given, sequence ``i``'s keys ``[kv_holes[i, 0], kv_holes[i, 1])`` are not
        seen (a KV policy's per-layer budgets, PyramidKV; ``lo == hi``: none). "xla" and
        "reference" only (``impl="auto"`` then takes "xla").

    Returns:
      ``[T, Hq, D]`` in ``q.dtype``; with ``mass_weight``
      ``(out, mass f32[max_num_seqs, Hkv, pages_per_seq * page])``.

    Raises:
      ValueError / TypeError: bad shapes, dtypes, knobs or ``impl``.
    """
    shp = validation.check_ragged_paged_attention(
        q, *validation.layer_view(k_pages, v_pages, layer), kv_lens, page_indices, cu_q_lens,
        num_seqs, sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    kind, style, interpret = resolve_impl(impl)
    if impl == "auto" and kind == "pallas" and not auto_fits(style, shp, q.dtype, config):
        kind, config = "xla", None
    validation.check_sliding_window(sliding_window)
    kw = {"sm_scale": sm_scale, "soft_cap": soft_cap, "sliding_window": sliding_window}
    if mass_weight is not None or kv_holes is not None:
        if impl == "auto":  # the Pallas styles do not return the mass (MASS) nor take holes
            kind, config = "xla", None
        if kind == "pallas":
            raise ValueError("mass_weight / kv_holes: not served by the Pallas kernels "
                             "(pallas_kernels.api.MASS); use impl='xla' or 'reference'")
    if mass_weight is not None:
        _check_mass(kind, mass_weight, q.shape[0])
        kw["mass_weight"] = mass_weight
    if kv_holes is not None:
        kw["kv_holes"] = kv_holes
    if kind == "xla":
        return xla.ragged_paged_attention(
            q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw, config=config,
            layer=layer,
        )  # fmt: skip
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if kind == "reference":
        return reference.ragged_paged_attention(*args, **kw)
    return _kernel("ragged_paged_attention", style)(*args, **kw, config=config, interpret=interpret)


def cascade_paged_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, page, D]
    v_pages: jax.Array,  # [Hkv, P, page, D]
    lengths: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    group_rows: jax.Array,  # i32[NG, R]
    prefix_lens: jax.Array,  # i32[NG]
    *,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    impl: str = "auto",
    config=None,
    layer=None,
) -> jax.Array:  # [B, Hq, D]
    """Decode attention with shared prefixes read once per group (cascade, :mod:`.cascade`).

    Group ``g`` has the member sequences ``group_rows[g, :]`` (-1: empty slot; a group whose
    first slot is -1 is padding) and shares its first ``prefix_lens[g] // page`` pages: attention
    over them is computed for all members' query rows at once and merged with each member's
    attention over its own remaining keys by log-sum-exp. Sequences in no group read all their
    pages. The result equals :func:`paged_attention` (up to float rounding) when every member's
    table starts with the group's shared pages (taken from its first member), each sequence is
    in at most one group, and ``prefix_lens[g] <= lengths[b]`` for its members; none of these
    traced facts is checked. Fixed ``[NG, R]`` shapes let a caller pad groups so that one
    compilation serves any number of groups.

    Args:
      q, k_pages, v_pages, lengths, page_indices: as in :func:`paged_attention`.
      group_rows: member sequence indices per group, -1 padded.
      prefix_lens: shared prefix tokens per group (rounded down to whole pages).
      sm_scale, soft_cap, impl, config, layer: as in :func:`paged_attention` (``config`` is the
        chosen implementation's paged tuning dataclass, used by both passes).

    Returns:
      ``[B, Hq, D]`` in ``q.dtype``.

    Raises:
      ValueError / TypeError: bad shapes, dtypes, knobs or ``impl``.
    """
    shp, _, _ = validation.check_cascade_paged_attention(
        q, *validation.layer_view(k_pages, v_pages, layer), lengths, page_indices, group_rows,
        prefix_lens, sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    kind, style, interpret = resolve_impl(impl)
    if impl == "auto" and kind == "pallas" and not auto_fits(style, shp, q.dtype, config):
        kind, config = "xla", None
    kw = {"sm_scale": sm_scale, "soft_cap": soft_cap}
    if kind == "xla":
        state_fn = functools.partial(xla.paged_attention, **kw, config=config, layer=layer,
                                     state=True)  # fmt: skip
    else:
        if layer is not None:
            k_pages, v_pages = k_pages[layer], v_pages[layer]
        if kind == "reference":
            state_fn = functools.partial(reference.paged_attention_state, **kw)
        else:
            state_fn = functools.partial(_kernel("paged_attention_state", style), **kw,
                                         config=config, interpret=interpret)  # fmt: skip
    # One computation, also when called eagerly: dispatching the glue op by op while an
    # interpret-mode kernel's callbacks still run deadlocks the CPU client (seen in TPU
    # interpret mode); inside a caller's jit this is an ordinary nested call.
    run = jax.jit(functools.partial(cascade.cascade, state_fn, num_kv_heads=shp.num_kv_heads,
                                    page_size=shp.page_size))  # fmt: skip
    return run(q, k_pages, v_pages, *map(jnp.asarray, (lengths, page_indices, group_rows,
                                                       prefix_lens)))  # fmt: skip


def flash_attention(
    q: jax.Array,  # [B, Tq, Hq, D]
    k: jax.Array,  # [B, Tk, Hkv, D]
    v: jax.Array,  # [B, Tk, Hkv, D]
    *,
    kv_lens: jax.Array | None = None,  # i32[B]
    causal: bool = True,
    sm_scale: float = 1.0,
    soft_cap: float | None = None,
    impl: str = "auto",
    config=None,
) -> jax.Array:  # [B, Tq, Hq, D]
    """Contiguous-KV attention (prefill when ``Tq == Tk``, the dense decode baseline when ``Tq == 1``).

    Batch ``b`` holds ``kv_lens[b]`` valid keys (default ``Tk``); query ``i`` sits at position
    ``kv_lens[b] - Tq + i`` and, if ``causal``, sees keys up to that position, otherwise all valid
    keys. Positions ``>= kv_lens[b]`` are never read; a query with no visible key gives zeros.

    Args:
      q, k, v: contiguous queries / keys / values, one dtype; ``Hq`` a multiple of ``Hkv``.
      kv_lens: valid keys per batch entry, in ``[0, Tk]``.
      causal: apply the causal mask.
      sm_scale, soft_cap, impl, config: as in :func:`paged_attention`.

    Returns:
      ``[B, Tq, Hq, D]`` in ``q.dtype``.

    Raises:
      ValueError / TypeError: bad shapes, dtypes, knobs or ``impl``.
    """
    validation.check_flash_attention(
        q, k, v, kv_lens, causal=causal, sm_scale=sm_scale, soft_cap=soft_cap
    )
    kind, style, interpret = resolve_impl(impl)
    kw = {"kv_lens": kv_lens, "causal": causal, "sm_scale": sm_scale, "soft_cap": soft_cap}
    if kind == "reference":
        return reference.flash_attention(q, k, v, **kw)
    if kind == "xla":
        return xla.flash_attention(q, k, v, **kw, config=config)
    return _kernel("flash_attention", style)(q, k, v, **kw, config=config, interpret=interpret)
