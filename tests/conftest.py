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
from pathlib import Path

# One persistent XLA compilation cache for the whole run: both pytest-xdist workers and every
# subprocess a test starts (servers, engine-core processes, forced-device and multi-host runs,
# study command lines) inherit these variables, so a step shape compiled once is loaded, not
# compiled again, by the others (the first tiny engine of a process: about 14 s cold, 2.6 s from
# the cache on this 2-core machine). Tracing still happens in every process, so the engines'
# trace counts (``num_compilations``) are unchanged; executables with host callbacks (Pallas
# interpret mode) are never cached by JAX. The cache lives in ``.cache/jax-tests`` of the checkout
# (git-ignored; a clean clone starts cold, a second run starts warm). ``PAGED_TEST_JAX_CACHE=0``
# turns it off, any other value moves it. Set before JAX is imported: JAX reads them at import.
_JAX_CACHE = os.environ.get(
    "PAGED_TEST_JAX_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "jax-tests"))
if _JAX_CACHE not in ("", "0"):
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    # No size bound: a bound turns on JAX's file lock, whose polling reads time.perf_counter and
    # sleeps, and under a test's patched clock (tests/test_replay.py) a contended lock made a
    # serving run's wall limit pass at once. Unlocked, a reader that meets an entry another
    # process is still writing fails to decompress it; JAX warns and compiles instead.

import jax  # noqa: E402
import pytest  # noqa: E402

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
