"""Exact byte and position accounting of a KV pool: the formulas and the ledger, in one namespace.

The formulas (``kv_bytes``, ``allocated_positions``, ``tail_waste``, ``position_utilization``,
``ModelSpec``, ...) live in ``paged.kv_formulas``; ``MemoryLedger`` (every byte of the pool in
exactly one category) in ``paged.ledger``, which builds on them. This module only gathers both,
so neither imports the other's importer.
"""

from __future__ import annotations

from paged.kv_formulas import (
    CATEGORIES,
    ModelSpec,
    allocated_positions,
    block_table_bytes,
    blocks_needed,
    check_lengths,
    kv_bytes,
    position_utilization,
    reservation_waste,
    tail_waste,
)
from paged.ledger import MemoryLedger

__all__ = [
    "CATEGORIES",
    "MemoryLedger",
    "ModelSpec",
    "allocated_positions",
    "block_table_bytes",
    "blocks_needed",
    "check_lengths",
    "kv_bytes",
    "position_utilization",
    "reservation_waste",
    "tail_waste",
]
