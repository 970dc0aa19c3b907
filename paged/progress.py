"""A progress bar for long engine loops: a tqdm bar on a terminal, one summary line otherwise."""

from __future__ import annotations

import contextlib
import sys
import time

import tqdm


@contextlib.contextmanager
def progress(total: int, enabled: bool, what: str = "requests"):
    """Yields ``update(n)``. On a terminal (stderr) a bar with rate and ETA that ends at N/N; off
    one, nothing until a single ``N/N <what> in S s`` line at the end (no carriage returns)."""
    tty = enabled and sys.stderr.isatty()
    start = time.perf_counter()
    done = [0]
    with tqdm.tqdm(total=total, unit=what[:3], disable=not tty, file=sys.stderr) as bar:
        def update(n: int) -> None:
            done[0] += n
            bar.update(n)

        yield update
    if enabled and not tty:
        print(f"{done[0]}/{total} {what} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
