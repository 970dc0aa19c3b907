"""Command lines that end in one clear line: ``fail(prog, message)`` prints ``prog: message`` on
stderr and exits with status 2, and ``OneLineParser`` is an ``argparse`` parser whose errors do
the same (no usage block, no traceback). Shared by ``python -m paged.server`` and
``python -m paged.router``."""

from __future__ import annotations

import argparse
import sys
import typing

USAGE_EXIT = 2


def fail(prog: str, message: str) -> typing.NoReturn:
    print(f"{prog}: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT)


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors end in one line named ``name``."""

    def __init__(self, *args, name: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = name

    def error(self, message):  # argparse hook
        fail(self.name, message)
