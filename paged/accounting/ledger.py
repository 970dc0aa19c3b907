"""``MemoryLedger``: a KV pool split, to the byte, into the categories of ``accounting.CATEGORIES``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from paged.accounting.formulas import CATEGORIES, ModelSpec, check_lengths, reservation_waste
from paged.util import validate


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
      effective_kv: bytes of filled positions in blocks owned by one sequence (verified tokens).
      staged: bytes of positions holding speculative tokens not verified yet (lookahead slots of
        a step in flight; 0 between steps).
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
      transfer: bytes of blocks held for a hand-over to another replica (prefill/decode
        disaggregation: a prefilled request's pages waiting for, or in, their transfer).
      scales: bytes of the scales of every block of the pool (quantized KV; 0 otherwise). The
        other categories count value bytes only, so scales are counted once, here.
      page_metadata: bytes of every block's page metadata (the key bounds of sparse decode; 0
        otherwise), counted once, here, like the scales.
      open_page_bytes: packed (int4 / int2) pages: bytes of the open-page buffer beside the pool
        (``paged.kv.open_pages``): a side cost, outside the pool's categories. The pool counts
        every page, the open ones included, at packed bytes; an open page is held in the model
        dtype, its head in its pool page's value bytes and its tail in a slot here (one model-
        dtype page less the packed value bytes per slot, ``paged.kv.packed_cache``); the saving
        is realized for closed pages only.
      open_pages_held: open-page slots held by a page in use.
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
    staged: int = 0
    scales: int = 0
    transfer: int = 0
    page_metadata: int = 0
    open_page_bytes: int = 0
    open_pages_held: int = 0

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
        out = {
            "layout": self.layout,
            "dtype": self.spec.dtype,
            "kv_cache_dtype": self.spec.kv_cache_dtype,
            "scale_granularity": self.spec.scale_granularity,
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
            "total_bytes": self.pool_bytes + self.block_table_bytes + self.workspace_bytes
            + self.open_page_bytes,
            "position_utilization": self.position_utilization,
        }
        if self.spec.packed_bits:  # the open pages beside a packed pool
            out["side_costs"]["open_page_bytes"] = self.open_page_bytes
            out["open_pages"] = {
                "held": self.open_pages_held,
                "held_bytes": self.open_pages_held * self.spec.open_page_bytes(self.block_size),
                "note": "packed pages: each running sequence's open page is held in the model "
                        "dtype until it fills: its head in its pool page's value bytes, its tail "
                        "in a slot beside the pool (side cost open_page_bytes)",
            }
        return out

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
        staged_positions: int = 0,
        transfer: int = 0,
        open_page_bytes: int = 0,
        open_pages_held: int = 0,
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
          staged_positions: filled positions of blocks owned by one sequence that hold
            speculative tokens not verified yet (counted as ``staged``, not ``effective_kv``).
          transfer: blocks held for a hand-over to another replica (not in ``used``).
          open_page_bytes, open_pages_held: packed pages' open-page buffer (see the class).

        Raises:
          TypeError: a count is not an integer or ``used`` holds a non-pair.
          ValueError: a count is out of range, or ``len(used) + cached_free + free + reserved +
            transfer + 1``
            differs from ``num_blocks``.
        """
        block_size = validate.integer("block_size", block_size, minimum=1)
        num_blocks = validate.integer("num_blocks", num_blocks, minimum=1)
        counts = {
            name: validate.integer(name, value, minimum=0)
            for name, value in (
                ("cached_free", cached_free),
                ("free", free),
                ("reserved", reserved),
                ("transfer", transfer),
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
        per_block = spec.value_bytes_per_block(block_size)
        per_token = per_block // block_size  # exact: packed pages too (whole bytes per token)
        own = sum(filled for ref, filled in blocks if ref == 1)
        shared = sum(filled for ref, filled in blocks if ref > 1)
        filled = own + shared
        staged = validate.integer("staged_positions", staged_positions, minimum=0, maximum=own)
        return cls(
            staged=staged * per_token,
            scales=num_blocks * spec.scale_bytes_per_block(block_size),
            page_metadata=num_blocks * spec.metadata_bytes_per_block(block_size),
            spec=spec,
            layout="paged",
            block_size=block_size,
            num_blocks=num_blocks,
            effective_kv=(own - staged) * per_token,
            shared=shared * per_token,
            tail_fragmentation=(len(blocks) * block_size - filled) * per_token,
            cached_free=counts["cached_free"] * per_block,
            free=counts["free"] * per_block,
            null_page=per_block,
            reserved=counts["reserved"] * per_block,
            transfer=counts["transfer"] * per_block,
            shared_saved_bytes=sum((ref - 1) * f for ref, f in blocks) * per_token,
            block_table_bytes=validate.integer("block_table_bytes", block_table_bytes, minimum=0),
            workspace_bytes=validate.integer("workspace_bytes", workspace_bytes, minimum=0),
            filled_positions=filled,
            in_use_positions=len(blocks) * block_size,
            open_page_bytes=validate.integer("open_page_bytes", open_page_bytes, minimum=0),
            open_pages_held=validate.integer("open_pages_held", open_pages_held, minimum=0),
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
        max_len = validate.integer("max_len", max_len, minimum=1)
        num_slots = validate.integer("num_slots", num_slots, minimum=1)
        ns = check_lengths(lengths, allow_empty=True)
        if len(ns) > num_slots:
            raise ValueError(f"{len(ns)} running requests do not fit num_slots={num_slots}")
        waste = sum(reservation_waste(n, max_len) for n in ns)
        per_token = spec.bytes_per_token
        return cls(
            scales=num_slots * spec.scale_bytes_per_block(max_len),
            page_metadata=num_slots * spec.metadata_bytes_per_block(max_len),
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
            block_table_bytes=validate.integer("block_table_bytes", block_table_bytes, minimum=0),
            workspace_bytes=validate.integer("workspace_bytes", workspace_bytes, minimum=0),
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
        ref = validate.integer(f"used[{i}].refcount", pair[0], minimum=1)
        filled = validate.integer(f"used[{i}].filled_slots", pair[1], minimum=0)
        if filled > block_size:
            raise ValueError(f"used[{i}].filled_slots={filled} exceeds block_size={block_size}")
        out.append((ref, filled))
    return out
