"""Exact byte and position accounting of a KV pool: the formulas and the ledger, in one namespace.

The formulas (``kv_bytes``, ``allocated_positions``, ``tail_waste``, ``position_utilization``,
``ModelSpec``, ...) live in ``paged.accounting.formulas``; ``MemoryLedger`` (every byte of the pool in
exactly one category) in ``paged.accounting.ledger``, which builds on them. This module only gathers both,
so neither imports the other's importer.
"""

from __future__ import annotations

from paged.accounting import formulas as kv_formulas
from paged.accounting.formulas import *  # noqa: F403 (this module gathers them)
from paged.accounting.ledger import MemoryLedger

__all__ = [*kv_formulas.__all__, "MemoryLedger"]
