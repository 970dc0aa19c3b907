"""Command lines that end in one clear line: ``fail(prog, message)`` prints ``prog: message`` on
stderr and exits with status 2, and ``OneLineParser`` is an ``argparse`` parser whose errors do
the same (no usage block, no traceback; a mistyped flag gets the closest real ones, as the
studies' keys do). Shared by ``python -m paged.server`` and
``python -m paged.router``."""

from __future__ import annotations

import argparse
import difflib
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
        fail(self.name, message + self.hint(message))

    def hint(self, message: str) -> str:
        """``"; did you mean --x?"`` for the unrecognized flags named in ``message``."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        flags = list(self._option_string_actions)
        out = []
        for arg in message.split(":", 1)[1].split():
            if arg.startswith("-"):
                near = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=4, cutoff=0.6)
                under = ("--" + f[2:].replace("-", "_") for f in near)  # one spelling each
                near = list(dict.fromkeys(u if u in flags else f for u, f in zip(under, near)))[:3]
                if near:
                    out.append(f"{arg.split('=', 1)[0]}: did you mean {' or '.join(near)}?")
        return "; " + "; ".join(out) if out else ""
