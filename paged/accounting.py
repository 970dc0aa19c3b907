"""Exact byte and position accounting for paged and fixed-reservation KV caches.

The formulas follow the source document (DESIGN.md, points 1 and 2):

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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "MemoryLedger",
    "ModelSpec",
    "allocated_positions",
    "block_table_bytes",
    "blocks_needed",
    "kv_bytes",
    "position_utilization",
    "reservation_waste",
    "tail_waste",
]

# Categories of a pool, in report order. Every byte of the pool is in exactly one of them.
CATEGORIES = (
    "effective_kv",
    "shared",
    "tail_fragmentation",
    "cached_free",
    "free",
    "null_page",
    "reserved",
)


# ----------------------------------------------------------------------------- validation


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    """Returns ``value`` as a Python int, or raises if it is not an integer ``>= minimum``."""
    # bool is an int subclass; True as a block size is almost certainly a bug, so refuse it.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an integer, got {type(value).__name__}")
    if value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name}={value} must be {kind}")
    return int(value)


def _check_lengths(lengths: Iterable[int], *, allow_empty: bool = False) -> list[int]:
    """Returns ``lengths`` as a list of non-negative ints, or raises naming the bad entry."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise TypeError(f"lengths={lengths!r} must be a sequence of integers")
    out = [_check_int(f"lengths[{i}]", n, minimum=0) for i, n in enumerate(lengths)]
    if not out and not allow_empty:
        raise ValueError("lengths=[] must hold at least one sequence length")
    return out


# ----------------------------------------------------------------------------- formulas


def kv_bytes(
    num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, bytes_per_scalar: int
) -> int:
    """KV bytes of ``num_tokens`` tokens: ``M_KV = 2 * L * n * h_kv * d_h * b``.

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
    num_layers = _check_int("num_layers", num_layers, minimum=1)
    num_tokens = _check_int("num_tokens", num_tokens, minimum=0)
    num_kv_heads = _check_int("num_kv_heads", num_kv_heads, minimum=1)
    head_dim = _check_int("head_dim", head_dim, minimum=1)
    bytes_per_scalar = _check_int("bytes_per_scalar", bytes_per_scalar, minimum=1)
    return 2 * num_layers * num_tokens * num_kv_heads * head_dim * bytes_per_scalar


def blocks_needed(n: int, block_size: int) -> int:
    """Physical blocks a sequence of ``n`` tokens needs: ``ceil(n / B)``.

    Raises:
      TypeError / ValueError: ``n`` is not a non-negative integer or ``block_size`` not positive.
    """
    n = _check_int("n", n, minimum=0)
    block_size = _check_int("block_size", block_size, minimum=1)
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
    n = _check_int("n", n, minimum=0)
    max_len = _check_int("max_len", max_len, minimum=1)
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
    ns = _check_lengths(lengths)
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
    num_seqs = _check_int("num_seqs", num_seqs, minimum=0)
    max_blocks_per_seq = _check_int("max_blocks_per_seq", max_blocks_per_seq, minimum=0)
    bytes_per_entry = _check_int("bytes_per_entry", bytes_per_entry, minimum=1)
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
      dtype: KV storage dtype; normalised to its name (``"float32"``, ``"bfloat16"``, ...).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, _check_int(name, getattr(self, name), minimum=1))
        object.__setattr__(self, "dtype", _dtype_of(self.dtype).name)

    @classmethod
    def from_model_config(cls, cfg: Any, *, dtype: Any = None) -> ModelSpec:
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
        )

    @property
    def bytes_per_scalar(self) -> int:
        """Bytes of one stored scalar ``b``."""
        return _dtype_of(self.dtype).itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers: ``2 * L * h_kv * d_h * b``."""
        return kv_bytes(self.num_layers, 1, self.num_kv_heads, self.head_dim, self.bytes_per_scalar)

    def bytes_per_block(self, block_size: int) -> int:
        """KV bytes of one physical block of ``block_size`` positions over all layers."""
        return self.bytes_per_token * _check_int("block_size", block_size, minimum=1)


# ----------------------------------------------------------------------------- ledger


@dataclasses.dataclass(frozen=True)
class MemoryLedger:
    """A KV pool split into categories that sum, to the byte, to the pool.

    Build it with ``from_blocks`` (paged pool) or ``for_reservation`` (contiguous baseline). Block
    tables and workspace live outside the pool and are reported beside it.

    Attributes:
      spec: model dimensions.
      layout: ``"paged"`` or ``"reservation"``.
      block_size: positions per block (``max_len`` for a reservation: one buffer is one block).
      num_blocks: physical blocks (buffers) in the pool, the null page included.
      effective_kv: bytes of filled positions in blocks owned by one sequence.
      shared: bytes of filled positions in blocks with refcount > 1, stored and counted once.
      tail_fragmentation: bytes of unfilled positions in in-use blocks (or reserved buffers).
      cached_free: bytes of free blocks still holding reusable prefix-cache content.
      free: bytes of free, empty blocks.
      null_page: bytes of the null page (padding target, never given to a sequence).
      reserved: bytes of blocks held back (e.g. quarantined until a device step finishes).
      shared_saved_bytes: bytes sharing avoided: ``sum((refcount - 1) * filled bytes)``.
      block_table_bytes: side cost, outside the pool.
      workspace_bytes: side cost, outside the pool.
      filled_positions: positions holding tokens in in-use blocks (shared ones counted once).
      in_use_positions: positions of in-use blocks.
    """

    spec: ModelSpec
    layout: str
    block_size: int
    num_blocks: int
    effective_kv: int
    shared: int
    tail_fragmentation: int
    cached_free: int
    free: int
    null_page: int
    reserved: int
    shared_saved_bytes: int
    block_table_bytes: int
    workspace_bytes: int
    filled_positions: int
    in_use_positions: int

    def __post_init__(self):
        # The whole point of the ledger: no byte of the pool unaccounted for, none counted twice.
        total = sum(self.categories().values())
        if total != self.pool_bytes:
            raise ValueError(
                f"ledger categories sum to {total} bytes, pool holds {self.pool_bytes} bytes"
            )

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole pool: ``num_blocks * bytes_per_block``."""
        return self.num_blocks * self.spec.bytes_per_block(self.block_size)

    @property
    def position_utilization(self) -> float | None:
        """Filled over allocated positions of in-use blocks; ``None`` when nothing is in use."""
        if self.in_use_positions == 0:
            return None
        return self.filled_positions / self.in_use_positions

    def categories(self) -> dict[str, int]:
        """Bytes per pool category, in report order; they sum to ``pool_bytes``."""
        return {name: getattr(self, name) for name in CATEGORIES}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary: categories, pool bytes, side costs and position utilization."""
        return {
            "layout": self.layout,
            "dtype": self.spec.dtype,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "bytes_per_block": self.spec.bytes_per_block(self.block_size),
            "pool_bytes": self.pool_bytes,
            "categories": self.categories(),
            "shared_saved_bytes": self.shared_saved_bytes,
            "side_costs": {
                "block_table_bytes": self.block_table_bytes,
                "workspace_bytes": self.workspace_bytes,
            },
            "total_bytes": self.pool_bytes + self.block_table_bytes + self.workspace_bytes,
            "position_utilization": self.position_utilization,
        }

    @classmethod
    def from_blocks(
        cls,
        spec: ModelSpec,
        block_size: int,
        num_blocks: int,
        *,
        used: Sequence[tuple[int, int]],
        cached_free: int,
        free: int,
        reserved: int = 0,
        block_table_bytes: int = 0,
        workspace_bytes: int = 0,
    ) -> MemoryLedger:
        """Ledger of a paged pool from per-block counts.

        Args:
          spec: model dimensions.
          block_size: positions per block.
          num_blocks: physical blocks in the pool, including the one null page.
          used: one ``(refcount, filled_slots)`` per in-use physical block (refcount >= 1,
            0 <= filled_slots <= block_size). A shared block appears once.
          cached_free: free blocks that keep prefix-cache content.
          free: free, empty blocks.
          reserved: blocks held back (quarantined or otherwise unavailable).
          block_table_bytes: bytes of block tables (outside the pool).
          workspace_bytes: bytes of attention/sampling workspace (outside the pool).

        Raises:
          TypeError: a count is not an integer or ``used`` holds a non-pair.
          ValueError: a count is out of range, or ``len(used) + cached_free + free + reserved + 1``
            differs from ``num_blocks``.
        """
        block_size = _check_int("block_size", block_size, minimum=1)
        num_blocks = _check_int("num_blocks", num_blocks, minimum=1)
        counts = {
            name: _check_int(name, value, minimum=0)
            for name, value in (
                ("cached_free", cached_free),
                ("free", free),
                ("reserved", reserved),
            )
        }
        blocks = _check_used(used, block_size)
        accounted = len(blocks) + sum(counts.values()) + 1  # + 1: the null page
        if accounted != num_blocks:
            parts = " + ".join(f"{k}={v}" for k, v in counts.items())
            raise ValueError(
                f"num_blocks={num_blocks} but used={len(blocks)} + {parts} + 1 null page"
                f" = {accounted}"
            )
        per_token = spec.bytes_per_token
        per_block = spec.bytes_per_block(block_size)
        own = sum(filled for ref, filled in blocks if ref == 1)
        shared = sum(filled for ref, filled in blocks if ref > 1)
        filled = own + shared
        return cls(
            spec=spec,
            layout="paged",
            block_size=block_size,
            num_blocks=num_blocks,
            effective_kv=own * per_token,
            shared=shared * per_token,
            tail_fragmentation=(len(blocks) * block_size - filled) * per_token,
            cached_free=counts["cached_free"] * per_block,
            free=counts["free"] * per_block,
            null_page=per_block,
            reserved=counts["reserved"] * per_block,
            shared_saved_bytes=sum((ref - 1) * f for ref, f in blocks) * per_token,
            block_table_bytes=_check_int("block_table_bytes", block_table_bytes, minimum=0),
            workspace_bytes=_check_int("workspace_bytes", workspace_bytes, minimum=0),
            filled_positions=filled,
            in_use_positions=len(blocks) * block_size,
        )

    @classmethod
    def for_reservation(
        cls,
        spec: ModelSpec,
        max_len: int,
        lengths: Iterable[int],
        *,
        num_slots: int,
        block_table_bytes: int = 0,
        workspace_bytes: int = 0,
    ) -> MemoryLedger:
        """Ledger of the contiguous baseline: ``num_slots`` buffers of ``max_len`` positions each.

        A running request of ``n`` tokens puts ``n`` positions in ``effective_kv`` and
        ``max_len - n`` in ``tail_fragmentation``; idle slots are ``free``. There is no null page
        and no sharing.

        Args:
          spec: model dimensions.
          max_len: positions reserved per slot.
          lengths: token count of each running request (may be empty: an idle pool).
          num_slots: buffers in the pool, at least ``len(lengths)``.
          block_table_bytes: side cost (e.g. per-slot offsets), outside the pool.
          workspace_bytes: side cost, outside the pool.

        Raises:
          TypeError / ValueError: a non-integer, a negative length, a length above ``max_len`` or
            more requests than slots.
        """
        max_len = _check_int("max_len", max_len, minimum=1)
        num_slots = _check_int("num_slots", num_slots, minimum=1)
        ns = _check_lengths(lengths, allow_empty=True)
        if len(ns) > num_slots:
            raise ValueError(f"{len(ns)} running requests do not fit num_slots={num_slots}")
        waste = sum(reservation_waste(n, max_len) for n in ns)
        per_token = spec.bytes_per_token
        return cls(
            spec=spec,
            layout="reservation",
            block_size=max_len,
            num_blocks=num_slots,
            effective_kv=sum(ns) * per_token,
            shared=0,
            tail_fragmentation=waste * per_token,
            cached_free=0,
            free=(num_slots - len(ns)) * max_len * per_token,
            null_page=0,
            reserved=0,
            shared_saved_bytes=0,
            block_table_bytes=_check_int("block_table_bytes", block_table_bytes, minimum=0),
            workspace_bytes=_check_int("workspace_bytes", workspace_bytes, minimum=0),
            filled_positions=sum(ns),
            in_use_positions=len(ns) * max_len,
        )


def _check_used(used: Sequence[tuple[int, int]], block_size: int) -> list[tuple[int, int]]:
    """Validates ``(refcount, filled_slots)`` pairs of in-use blocks."""
    if isinstance(used, (str, bytes, Mapping)) or not isinstance(used, Iterable):
        raise TypeError(f"used={used!r} must be a sequence of (refcount, filled_slots) pairs")
    out = []
    for i, pair in enumerate(used):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"used[{i}]={pair!r} must be a (refcount, filled_slots) pair")
        ref = _check_int(f"used[{i}].refcount", pair[0], minimum=1)
        filled = _check_int(f"used[{i}].filled_slots", pair[1], minimum=0)
        if filled > block_size:
            raise ValueError(f"used[{i}].filled_slots={filled} exceeds block_size={block_size}")
        out.append((ref, filled))
    return out
