"""Suite-wide hygiene: compiled executables are dropped when they pile up.

The default suite compiles thousands of XLA executables in one process; each keeps JIT code
mapped in memory. Clearing JAX's caches keeps the process's memory maps and RSS bounded (a late
module otherwise compiles into an address space that earlier ones filled). Clearing after every
module, though, makes each module recompile the step shapes the previous ones already had (the
engine tests share one small model and a few shapes), so the caches are dropped only once the
process holds more than ``PAGED_TEST_MAX_RSS_GB`` GiB resident or ``PAGED_TEST_MAX_MAPS`` memory
maps (defaults 6 and 20000; 0 clears after every module, the old behaviour).
"""

from __future__ import annotations

import gc
import os

import jax
import pytest

_MAX_RSS = float(os.environ.get("PAGED_TEST_MAX_RSS_GB", "6")) * 2**30
_MAX_MAPS = int(os.environ.get("PAGED_TEST_MAX_MAPS", "20000"))


def _over_limits() -> bool:
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
    except OSError:  # not Linux: clear as before
        return True
    return rss > _MAX_RSS or maps > _MAX_MAPS


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_executables():
    yield
    if _MAX_RSS <= 0 or _over_limits():
        jax.clear_caches()
        gc.collect()
