"""Exact byte and position accounting for paged and fixed-reservation KV caches.

The formulas:

* ``M_KV = 2 * L * n * h_kv * d_h * b`` bytes of KV for ``n`` tokens (2 = key and value). It counts
  neither block tables nor workspace nor padding; those are reported beside the pool, never inside.
* ``A_B(n) = B * ceil(n / B)`` positions allocated to a sequence of ``n`` tokens in blocks of ``B``;
  ``W_B(n) = A_B(n) - n`` positions of tail waste, at most ``B - 1``. A fixed reservation of ``M``
  positions wastes ``M - n``.
* ``U = sum(n_i) / sum(A_B(n_i))`` is *position* utilization: it says nothing about device
  utilization or throughput.

Everything here is plain Python integers, so totals are exact; ``MemoryLedger`` asserts that its
categories add up to the pool to the byte.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from paged.util import validate

__all__ = [
    "CATEGORIES",
    "ModelSpec",
    "PACKED_BITS",
    "PACKED_SCALE_BYTES",
    "QUANT_ITEMSIZE",
    "SCALE_BYTES",
    "allocated_positions",
    "block_table_bytes",
    "blocks_needed",
    "check_lengths",
    "kv_bytes",
    "position_utilization",
    "reservation_waste",
    "tail_waste",
]

# Categories of a pool, in report order. Every byte of the pool is in exactly one of them.
CATEGORIES = (
    "effective_kv",
    "staged",
    "shared",
    "tail_fragmentation",
    "cached_free",
    "free",
    "null_page",
    "reserved",
    "transfer",
    "scales",
    "page_metadata",
)

#: Bytes per stored value of each quantized ``kv_cache_dtype`` (``pallas_kernels.quant``'s formats)
#: and of one scale (float32); "auto" stores the model dtype. Kept here as plain integers so the
#: formulas need no JAX; a test checks them against the allocated arrays' ``nbytes``.
QUANT_ITEMSIZE = {"int8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
SCALE_BYTES = 4
#: Bits per value of the packed sub-byte formats (``pallas_kernels.packed``, KIVI layout: keys
#: per channel, values per token, asymmetric) and bytes of each of their scales and zero points
#: (float16). A closed page of one (layer, KV head) holds ``page * D * bits / 8`` value bytes of K
#: and of V, ``D`` key scales and zeros (one per channel) and ``page`` value scales and zeros (one
#: per token); the open page of a running sequence is held in the model dtype: its head in its
#: pool page's value bytes, its tail in a slot beside the pool (``ModelSpec.open_page_bytes``).
PACKED_BITS = {"int4": 4, "int2": 2}
PACKED_SCALE_BYTES = 2
SCALE_GRANULARITIES = ("token", "page")


# ----------------------------------------------------------------------------- validation


def check_lengths(lengths: Iterable[int], *, allow_empty: bool = False) -> list[int]:
    """Returns ``lengths`` as a list of non-negative ints, or raises naming the bad entry."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise TypeError(f"lengths={lengths!r} must be a sequence of integers")
    out = [validate.integer(f"lengths[{i}]", n, minimum=0) for i, n in enumerate(lengths)]
    if not out and not allow_empty:
        raise ValueError("lengths=[] must hold at least one sequence length")
    return out


# ----------------------------------------------------------------------------- formulas


def kv_bytes(
    num_layers, num_tokens: int, num_kv_heads: int | None = None, head_dim: int | None = None,
    bytes_per_scalar: int | None = None, *, kv_cache_dtype: str | None = None,
    scale_granularity: str | None = None, page_size: int | None = None,
) -> int:
    """KV bytes of ``num_tokens`` tokens: ``M_KV = 2 * L * n * h_kv * d_h * b``.

    Two forms. ``kv_bytes(L, n, h_kv, d_h, b)``: the formula. ``kv_bytes(spec, n, *,
    kv_cache_dtype=..., scale_granularity=..., page_size=...)`` with a :class:`ModelSpec`: exact
    bytes of a (possibly quantized) cache, scales included: ``b`` is the stored value's size and a
    quantized cache adds ``2 * L * h_kv * 4`` bytes per token ("token" scales) or per page of
    ``page_size`` tokens, ``ceil(n / page_size)`` pages ("page" scales); a packed format ("int4",
    "int2") counts its ``ceil(n / page_size)`` pool pages with their scales and zero points (a
    running sequence's open page: ``ModelSpec.sequence_bytes``). The keywords override
    the spec's own ``kv_cache_dtype`` / ``scale_granularity``.

    Args:
      num_layers: decoder layers ``L``.
      num_tokens: tokens held ``n`` (may be 0).
      num_kv_heads: KV heads ``h_kv`` (fewer than query heads under GQA/MQA, which is why cache size
        cannot be derived from parameter count).
      head_dim: head dimension ``d_h``.
      bytes_per_scalar: bytes per stored scalar ``b`` (2 for bfloat16).

    Returns:
      Bytes of keys plus values; excludes block tables, workspace and padding.

    Raises:
      TypeError: an argument is not an integer.
      ValueError: ``num_tokens`` is negative or another argument is not positive.
    """
    if isinstance(num_layers, ModelSpec):
        return _spec_kv_bytes(num_layers, num_tokens, kv_cache_dtype, scale_granularity,
                              page_size)
    num_layers = validate.integer("num_layers", num_layers, minimum=1)
    num_tokens = validate.integer("num_tokens", num_tokens, minimum=0)
    num_kv_heads = validate.integer("num_kv_heads", num_kv_heads, minimum=1)
    head_dim = validate.integer("head_dim", head_dim, minimum=1)
    bytes_per_scalar = validate.integer("bytes_per_scalar", bytes_per_scalar, minimum=1)
    return 2 * num_layers * num_tokens * num_kv_heads * head_dim * bytes_per_scalar


def _spec_kv_bytes(spec, num_tokens, kv_cache_dtype, scale_granularity, page_size) -> int:
    overrides = {k: v for k, v in (("kv_cache_dtype", kv_cache_dtype),
                                   ("scale_granularity", scale_granularity)) if v is not None}
    spec = dataclasses.replace(spec, **overrides)
    num_tokens = validate.integer("num_tokens", num_tokens, minimum=0)
    if spec.packed_bits is not None:  # whole packed pages; a running sequence's open page aside
        if page_size is None:
            raise ValueError(f"kv_cache_dtype={spec.kv_cache_dtype!r} needs page_size to count "
                             "its packed pages")
        return blocks_needed(num_tokens, page_size) * spec.bytes_per_block(page_size)
    values = num_tokens * spec.bytes_per_token
    if spec.kv_cache_dtype == "auto":
        return values
    per_scale = 2 * spec.num_layers * spec.num_kv_heads * SCALE_BYTES
    if spec.scale_granularity == "token":
        return values + num_tokens * per_scale
    if page_size is None:
        raise ValueError("scale_granularity='page' needs page_size to count the pages' scales")
    return values + blocks_needed(num_tokens, page_size) * per_scale


def blocks_needed(n: int, block_size: int) -> int:
    """Physical blocks a sequence of ``n`` tokens needs: ``ceil(n / B)``.

    Raises:
      TypeError / ValueError: ``n`` is not a non-negative integer or ``block_size`` not positive.
    """
    n = validate.integer("n", n, minimum=0)
    block_size = validate.integer("block_size", block_size, minimum=1)
    return -(-n // block_size)  # integer ceil: float division loses exactness for huge n


def allocated_positions(n: int, block_size: int) -> int:
    """Positions allocated to ``n`` tokens in blocks of ``block_size``: ``A_B(n) = B * ceil(n/B)``.

    Raises:
      TypeError / ValueError: ``n`` is not a non-negative integer or ``block_size`` not positive.
    """
    return int(block_size) * blocks_needed(n, block_size)


def tail_waste(n: int, block_size: int) -> int:
    """Unfilled positions of the last block: ``W_B(n) = A_B(n) - n``, in ``[0, B - 1]``.

    Raises:
      TypeError / ValueError: ``n`` is not a non-negative integer or ``block_size`` not positive.
    """
    return allocated_positions(n, block_size) - int(n)


def reservation_waste(n: int, max_len: int) -> int:
    """Positions a fixed reservation of ``max_len`` wastes on ``n`` tokens: ``M - n``.

    Raises:
      TypeError / ValueError: a non-integer, a negative ``n``, ``max_len < 1`` or ``n > max_len``.
    """
    n = validate.integer("n", n, minimum=0)
    max_len = validate.integer("max_len", max_len, minimum=1)
    if n > max_len:
        raise ValueError(f"n={n} exceeds max_len={max_len}")
    return max_len - n


def position_utilization(
    lengths: Iterable[int], *, block_size: int | None = None, max_len: int | None = None
) -> float:
    """Valid positions over allocated positions, for paging or for a fixed reservation.

    Paged (``block_size`` given): ``sum(n_i) / sum(B * ceil(n_i / B))``. Fixed reservation
    (``max_len`` given): ``sum(n_i) / (len(lengths) * max_len)``. This is position utilization only;
    it ignores block tables, sharing and scheduling and is not device utilization.

    Args:
      lengths: token count of each sequence.
      block_size: positions per block (paged).
      max_len: positions reserved per sequence (fixed reservation).

    Returns:
      A float in ``[0, 1]``.

    Raises:
      TypeError: a length or size is not an integer.
      ValueError: not exactly one of ``block_size`` / ``max_len`` is given; ``lengths`` is empty or
        holds a negative length or one above ``max_len``; a size is not positive; or the lengths
        allocate no position at all (0 / 0).
    """
    if (block_size is None) == (max_len is None):
        raise ValueError(
            f"give exactly one of block_size={block_size} and max_len={max_len} "
            "(paged vs fixed reservation)"
        )
    ns = check_lengths(lengths)
    if block_size is not None:
        allocated = sum(allocated_positions(n, block_size) for n in ns)
    else:
        for n in ns:
            reservation_waste(n, max_len)  # validates max_len and refuses n > max_len
        allocated = len(ns) * int(max_len)
    if allocated == 0:
        raise ValueError(f"lengths={ns} allocate no positions; utilization 0/0 is undefined")
    return sum(ns) / allocated


def block_table_bytes(num_seqs: int, max_blocks_per_seq: int, bytes_per_entry: int = 4) -> int:
    """Bytes of a dense block table: one row of ``max_blocks_per_seq`` entries per sequence.

    Args:
      num_seqs: rows (sequences).
      max_blocks_per_seq: entries per row, usually ``ceil(max_len / block_size)``.
      bytes_per_entry: 4 for the i32 page indices the kernels take.

    Raises:
      TypeError / ValueError: an argument is not an integer, or is negative (``bytes_per_entry``
        must be positive).
    """
    num_seqs = validate.integer("num_seqs", num_seqs, minimum=0)
    max_blocks_per_seq = validate.integer("max_blocks_per_seq", max_blocks_per_seq, minimum=0)
    bytes_per_entry = validate.integer("bytes_per_entry", bytes_per_entry, minimum=1)
    return num_seqs * max_blocks_per_seq * bytes_per_entry


# ----------------------------------------------------------------------------- model spec


def _dtype_of(dtype: Any) -> np.dtype:
    """Resolves a numpy/jax dtype or its name, including ml_dtypes names such as ``bfloat16``."""
    try:
        return np.dtype(dtype)
    except TypeError:
        pass
    if isinstance(dtype, str):
        try:  # ml_dtypes (a jax dependency) holds bfloat16 / float8 types numpy does not know.
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, dtype))
        except (ImportError, AttributeError, TypeError):
            pass
    raise TypeError(f"dtype={dtype!r} is not a numpy/jax dtype or dtype name")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The model dimensions that set KV size.

    Attributes:
      num_layers: decoder layers ``L``.
      num_kv_heads: KV heads ``h_kv``.
      head_dim: head dimension ``d_h``.
      dtype: model (and, with ``kv_cache_dtype="auto"``, KV storage) dtype; normalised to its
        name (``"float32"``, ``"bfloat16"``, ...).
      kv_cache_dtype: "auto" (``dtype``) or a quantized format ("int8", "fp8_e4m3", "fp8_e5m2":
        one byte per value plus float32 scales; "int4", "int2": packed KIVI pages, see
        :data:`PACKED_BITS`, plus one open page per running sequence in ``dtype``).
      scale_granularity: quantized only: "token" (a scale per (token, KV head)) or "page" (per
        (page, KV head)).
      page_bounds: each page also holds its keys' element-wise minimum and maximum per KV head
        (sparse decode): ``2 * L * h_kv * d_h`` values of ``dtype`` per block.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    scale_granularity: str = "token"
    page_bounds: bool = False

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, validate.integer(name, getattr(self, name), minimum=1))
        object.__setattr__(self, "dtype", _dtype_of(self.dtype).name)
        validate.one_of("kv_cache_dtype", self.kv_cache_dtype,
                        ("auto", *QUANT_ITEMSIZE, *PACKED_BITS))
        validate.one_of("scale_granularity", self.scale_granularity, SCALE_GRANULARITIES)

    @classmethod
    def from_model_config(cls, cfg: Any, *, dtype: Any = None, kv_cache_dtype: str = "auto",
                          scale_granularity: str = "token", page_bounds: bool = False) -> ModelSpec:
        """Reads ``num_layers``, ``num_kv_heads``, ``head_dim`` and ``dtype`` from any object.

        Args:
          cfg: a model config (dataclass, ConfigDict, namespace) with those attributes.
          dtype: overrides ``cfg.dtype`` when the cache is stored in another dtype than the model.

        Raises:
          TypeError: ``cfg`` lacks one of the attributes.
        """
        names = ("num_layers", "num_kv_heads", "head_dim") + (("dtype",) if dtype is None else ())
        missing = [n for n in names if not hasattr(cfg, n)]
        if missing:
            raise TypeError(f"{type(cfg).__name__} has no attribute(s) {missing} for ModelSpec")
        return cls(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=cfg.dtype if dtype is None else dtype,
            kv_cache_dtype=kv_cache_dtype,
            scale_granularity=scale_granularity,
            page_bounds=page_bounds,
        )

    @classmethod
    def from_hf_config(cls, path: Any, *, dtype: Any = None) -> ModelSpec:
        """Reads a Hugging Face ``config.json`` (or a checkpoint directory holding one).

        ``head_dim`` is the config's ``head_dim`` key, else ``hidden_size // num_attention_heads``;
        ``num_key_value_heads`` defaults to ``num_attention_heads``. The dtype is ``dtype``, else
        the config's ``dtype`` / ``torch_dtype``, else float32.

        Raises:
          ValueError: what `paged.models.hf_config.read_hf_config` refuses (naming file and key).
        """
        from paged.models.hf_config import read_hf_config

        model = read_hf_config(path)
        stored = model.raw.get("dtype") or model.raw.get("torch_dtype") or "float32"
        return cls.from_model_config(model.config, dtype=stored if dtype is None else dtype)

    @property
    def packed_bits(self) -> int | None:
        """Bits per value of a packed format ("int4": 4, "int2": 2), else None."""
        return PACKED_BITS.get(self.kv_cache_dtype)

    @property
    def bytes_per_scalar(self) -> int:
        """Bytes of one stored value ``b`` (1 for a quantized cache).

        Raises:
          ValueError: a packed format (less than a byte per value: count per block)."""
        if self.packed_bits is not None:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} packs {self.packed_bits} "
                             "bits per value: count bytes per block (value_bytes_per_block)")
        if self.kv_cache_dtype != "auto":
            return QUANT_ITEMSIZE[self.kv_cache_dtype]
        return _dtype_of(self.dtype).itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV value bytes of one token over all layers: ``2 * L * h_kv * d_h * b`` (scales are
        counted per block, :meth:`scale_bytes_per_block`)."""
        return kv_bytes(self.num_layers, 1, self.num_kv_heads, self.head_dim, self.bytes_per_scalar)

    def scale_bytes_per_block(self, block_size: int) -> int:
        """Scale bytes of one physical block over all layers (0 unless quantized)."""
        block_size = validate.integer("block_size", block_size, minimum=1)
        if self.kv_cache_dtype == "auto":
            return 0
        if self.packed_bits is not None:  # K: per channel; V: per token; a scale and a zero each
            return (self.num_layers * self.num_kv_heads * (self.head_dim + block_size)
                    * 2 * PACKED_SCALE_BYTES)
        width = block_size if self.scale_granularity == "token" else 1
        return 2 * self.num_layers * self.num_kv_heads * width * SCALE_BYTES

    def metadata_bytes_per_block(self, block_size: int) -> int:
        """Page-metadata bytes of one physical block over all layers: the key bounds of sparse
        decode (0 without them; independent of ``block_size``)."""
        validate.integer("block_size", block_size, minimum=1)
        if not self.page_bounds:
            return 0
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _dtype_of(self.dtype).itemsize

    def value_bytes_per_block(self, block_size: int) -> int:
        """KV value bytes of one physical block of ``block_size`` positions (no scales).

        Raises:
          ValueError: a packed format whose head dim does not pack into whole bytes."""
        if self.packed_bits is not None:
            block_size = validate.integer("block_size", block_size, minimum=1)
            bits = self.num_layers * self.num_kv_heads * block_size * self.head_dim \
                * self.packed_bits
            if self.head_dim * self.packed_bits % 8:
                raise ValueError(f"head_dim={self.head_dim} does not pack into whole bytes at "
                                 f"{self.packed_bits} bits per value")
            return 2 * bits // 8
        return self.bytes_per_token * validate.integer("block_size", block_size, minimum=1)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one physical block of ``block_size`` positions over all layers, scales and
        page metadata included: what the pool allocates per page."""
        return (self.value_bytes_per_block(block_size) + self.scale_bytes_per_block(block_size)
                + self.metadata_bytes_per_block(block_size))

    def open_page_bytes(self, block_size: int) -> int:
        """Bytes of one running sequence's open-page slot over all layers: a page in the model
        ``dtype`` less the packed page's value bytes, where the open page's head is held (its
        pool page holds no quantized values until it fills, ``paged.kv.packed_cache``); 0 for
        every format but the packed ones."""
        block_size = validate.integer("block_size", block_size, minimum=1)
        if self.packed_bits is None:
            return 0
        return (kv_bytes(self.num_layers, block_size, self.num_kv_heads, self.head_dim,
                         _dtype_of(self.dtype).itemsize)
                - 2 * self.num_layers * self.num_kv_heads * block_size * self.head_dim
                * self.packed_bits // 8)

    def sequence_bytes(self, num_tokens: int, block_size: int, *, running: bool = True) -> int:
        """Bytes one sequence of ``num_tokens`` holds: ``ceil(n / B)`` pool blocks (scales
        included) plus, for a running sequence in a packed format, its open-page slot. The open
        page's pool page is allocated with its first token (as the block manager allocates every
        page) and holds the open page's head in its value bytes until the page fills (the slot
        holds the rest): a running sequence costs its closed pages, one model-dtype page and one
        page's scales and zero points."""
        blocks = blocks_needed(num_tokens, block_size) * self.bytes_per_block(block_size)
        return blocks + (self.open_page_bytes(block_size) if running else 0)

    def sequences_for_bytes(self, budget_bytes: int, num_tokens: int, block_size: int) -> int:
        """Running sequences of ``num_tokens`` tokens a KV budget of ``budget_bytes`` holds
        (:meth:`sequence_bytes` each; the null page not counted)."""
        budget_bytes = validate.integer("budget_bytes", budget_bytes, minimum=0)
        return budget_bytes // self.sequence_bytes(max(num_tokens, 1), block_size)

    def blocks_for_bytes(self, budget_bytes: int, block_size: int) -> int:
        """Physical blocks (null page included) a pool of ``budget_bytes`` affords: the page
        count each KV dtype gets from the same bytes.

        Raises:
          TypeError / ValueError: a non-integer or negative budget, or ``block_size < 1``.
        """
        budget_bytes = validate.integer("budget_bytes", budget_bytes, minimum=0)
        return budget_bytes // self.bytes_per_block(block_size)


