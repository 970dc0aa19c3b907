"""Suite-wide hygiene: each test module's compiled executables are dropped when it ends.

The default suite compiles thousands of XLA executables in one process; each keeps JIT code
mapped in memory. Clearing JAX's caches between modules keeps the process's memory maps and RSS
bounded (a late module otherwise compiles into an address space that earlier ones filled).
"""

from __future__ import annotations

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_executables():
    yield
    jax.clear_caches()
    gc.collect()
