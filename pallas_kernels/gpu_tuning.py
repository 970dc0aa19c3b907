"""Launch-shape heuristics of the GPU-style paged decode kernel (split-K flash-decoding).

:func:`decode_splits` picks ``(k_splits, pages_per_compute_block)`` from the static shape when the
caller gives none (``GpuPagedConfig(k_splits=None)`` / ``pages_per_compute_block=None``); explicit
values always win. The kernel's grid is ``batch x num_kv_heads x k_splits`` programs (CTAs). The
rules, in order:

  1. Compute block: ``block_tokens`` (128) keys per loop step, i.e. ``128 // page_size`` pages
     (at least one page; the kernel raises it further so a block holds >= 16 keys).
  2. Occupancy: the fewest power-of-two splits with ``batch * num_kv_heads * k_splits >=
     ctas_per_sm * num_sms`` (default 2 waves of CTAs over the SMs), so a small decode batch still
     fills the GPU.
  3. Work per CTA: at least ``ceil(context / max_tokens_per_split)`` splits (2048 keys), so one CTA
     does not walk a long context alone while the others idle at the tail of the grid.
  4. Floor: never below ``min_blocks_per_split`` (2) compute blocks per split: shorter splits pay
     more for their float32 partials (written, then merged) than they gain in parallelism.
  5. Capped at ``max_splits`` (64).

Calibration (one H200, 132 SMs, B=64, Hkv=8, context 4096, page 16, bf16): 2 splits x 8 pages per
block ran at 87 % of the copy bandwidth, 4 / 8 / 16 splits at 84 / 81 / 77 % and 16 pages per block
at 58 %; a single split was not measured. The rules give (2, 8) there: rule 2 alone asks for 1 (512
CTAs >= 264), rule 3 for 2. Other shapes are extrapolation until the decode grid of the ``h200``
kernel-bench config has measured them.
"""

from __future__ import annotations

H200_SMS = 132  # streaming multiprocessors of an H200 (and H100 SXM)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _prev_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def decode_splits(
    batch: int,
    num_kv_heads: int,
    context: int,
    page_size: int,
    num_sms: int = H200_SMS,
    *,
    ctas_per_sm: int = 2,
    block_tokens: int = 128,
    max_tokens_per_split: int = 2048,
    min_blocks_per_split: int = 2,
    max_splits: int = 64,
) -> tuple[int, int]:
    """``(k_splits, pages_per_compute_block)`` for a decode of ``batch`` sequences of up to
    ``context`` keys (the page table's capacity, ``pages_per_seq * page_size``), both powers of two.

    See the module docstring for the rules. ``k_splits`` is at least 1 and at most
    ``max(1, pages_per_seq // (min_blocks_per_split * pages_per_compute_block))``.

    Raises:
      ValueError: a non-positive argument.
    """
    for name, value in (("batch", batch), ("num_kv_heads", num_kv_heads), ("context", context),
                        ("page_size", page_size), ("num_sms", num_sms)):  # fmt: skip
        if int(value) < 1:
            raise ValueError(f"{name}={value!r} must be >= 1")
    pages = -(-int(context) // int(page_size))
    ppb = min(_next_pow2(max(1, block_tokens // page_size)), _next_pow2(pages))
    ctas = int(batch) * int(num_kv_heads)
    want = max(_next_pow2(-(-ctas_per_sm * num_sms // ctas)),
               _next_pow2(-(-int(context) // max_tokens_per_split)))  # fmt: skip
    most = max(1, _prev_pow2(max(1, pages // (min_blocks_per_split * ppb))))
    return max(1, min(want, most, max_splits)), ppb


def device_sms(default: int = H200_SMS) -> int:
    """The SM count of the first JAX device (``Device.core_count`` on GPUs), else ``default``."""
    try:
        import jax

        count = getattr(jax.devices()[0], "core_count", None)
    except Exception:  # noqa: BLE001 - no backend yet, or a platform without the attribute
        count = None
    return int(count) if isinstance(count, int) and count > 0 else default


def resolve_decode_config(config, *, batch: int, num_kv_heads: int, pages_per_seq: int,
                          page_size: int, num_sms: int | None = None):  # fmt: skip
    """``config`` (a ``GpuPagedConfig``) with ``k_splits`` / ``pages_per_compute_block`` that are
    None filled in by :func:`decode_splits`; explicit values are kept as given."""
    import dataclasses

    if config.k_splits is not None and config.pages_per_compute_block is not None:
        return config
    splits, ppb = decode_splits(batch, num_kv_heads, pages_per_seq * page_size, page_size,
                                num_sms or device_sms())  # fmt: skip
    return dataclasses.replace(
        config,
        k_splits=config.k_splits if config.k_splits is not None else splits,
        pages_per_compute_block=config.pages_per_compute_block or ppb,
    )
