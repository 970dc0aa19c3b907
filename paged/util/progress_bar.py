"""The one progress helper of the project (the library, the server's warmup and every study).

`Progress` counts a loop over ``total`` items. On a terminal: a tqdm bar (count, rate, ETA, a
postfix). Off a terminal (piped to a file, a test's capture): nothing while it runs, then one
summary line when it closes, so a log has no carriage-return updates run together; with
``lines=True`` also one line per update (count, elapsed time, the postfix), for loops whose steps
are long enough that a reader wants to see them (the warmup's compilations).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from typing import Any


class Progress:
    """Progress of a loop over ``total`` items (see the module docstring).

    The count is what the caller last set, so a loop whose items all finished ends at
    ``total/total``. ``enabled=False`` shows and prints nothing.
    """

    def __init__(self, total: int, desc: str, *, unit: str = "req", summary: bool = True,
                 file=None, lines: bool = False, enabled: bool = True):
        from tqdm import tqdm

        self.file = file or sys.stderr
        self.enabled = enabled
        self.tty = enabled and bool(getattr(self.file, "isatty", lambda: False)())
        self.total, self.desc, self.unit = total, desc, unit
        self.summary, self.lines = summary and enabled, lines and enabled
        self.n, self.t0, self.closed, self.note = 0, time.perf_counter(), False, ""
        # A terminal that reports no size (0 x 0) would hide the bar: fall back to 100 x 20.
        size = shutil.get_terminal_size((100, 20))
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file, disable=not self.tty,
                        ncols=min(size.columns or 100, 120), nrows=max(size.lines, 20),
                        leave=True, mininterval=0.2)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def set(self, n: int, **postfix: Any) -> None:
        """Sets the count to ``n`` (and the postfix shown beside the bar)."""
        moved = n != self.n
        if moved:
            self.bar.update(n - self.n)
            self.n = n
        if postfix:
            self.note = ", ".join(f"{k} {v}" for k, v in postfix.items())
            self.bar.set_postfix_str(self.note, refresh=False)
        if self.lines and not self.tty and moved:
            note = f" ({self.note})" if self.note else ""
            print(f"{self.desc} {self.n}/{self.total} {self.unit}, {self.elapsed:.1f} s{note}",
                  file=self.file, flush=True)

    def update(self, k: int = 1) -> None:
        self.set(self.n + k)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.bar.close()
        if not self.tty and self.summary:
            wall = self.elapsed
            rate = self.n / wall if wall > 0 else 0.0
            print(f"{self.desc} {self.n}/{self.total} {self.unit} in {wall:.1f} s "
                  f"({rate:.2f} {self.unit}/s)", file=self.file, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def progress(total: int, enabled: bool, what: str = "requests"):
    """`Progress` as a context that yields ``update(n)`` (``Engine.generate(progress=True)``)."""
    with Progress(total, what, unit=what[:3], enabled=enabled) as bar:
        yield bar.update
