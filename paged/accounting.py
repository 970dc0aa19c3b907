"""Exact byte and position accounting of a KV pool: the formulas and the ledger, in one namespace.

The formulas (``kv_bytes``, ``allocated_positions``, ``tail_waste``, ``position_utilization``,
``ModelSpec``, ...) live in ``paged.kv_formulas``; ``MemoryLedger`` (every byte of the pool in
exactly one category) in ``paged.ledger``, which builds on them. This module only gathers both,
so neither imports the other's importer.
"""

from __future__ import annotations

from paged import kv_formulas
from paged.kv_formulas import *  # noqa: F403 (this module gathers them)
from paged.ledger import MemoryLedger

__all__ = [*kv_formulas.__all__, "MemoryLedger"]
