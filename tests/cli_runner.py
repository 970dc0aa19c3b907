"""``python -m <module> <args>`` for many short command lines, without paying Python's and JAX's
start-up for each one.

A command line that fails in its config check spends about 2 CPU-seconds starting Python and
importing JAX, NumPy, absl and the study, and well under 0.1 s doing what the test checks. A
`ForkRunner` starts one helper process that imports those modules once (JAX's backend is never
started there), then forks a child per command line: the child redirects its stdout and stderr
to files, changes to ``cwd`` and runs the module as ``__main__`` (`runpy`, as ``python -m`` does),
and its exit status, stdout and stderr come back as a `subprocess.CompletedProcess`. Whatever the
helper's imports printed is put in front of every child's stdout and stderr, so a test that wants
"nothing but one line on stderr" still sees import-time noise. Without ``os.fork`` (not POSIX) it
falls back to one ``subprocess.run`` per command line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

_HELPER = r"""
import importlib, json, os, runpy, signal, sys, tempfile, traceback

def _capture(fd):
    f = tempfile.TemporaryFile()
    saved = os.dup(fd)
    os.dup2(f.fileno(), fd)
    return f, saved

proto = os.fdopen(os.dup(1), "w")
(out, saved_out), (err, saved_err) = _capture(1), _capture(2)
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
sys.stdout.flush(); sys.stderr.flush()
os.dup2(saved_out, 1); os.dup2(saved_err, 2)
prefix = []
for f in (out, err):
    f.seek(0); prefix.append(f.read().decode(errors="replace")); f.close()

for line in sys.stdin:
    req = json.loads(line)
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0); os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
            signal.alarm(req["timeout"])
            os.chdir(req["cwd"])
            sys.argv = [req["module"], *req["args"]]
            # As under python -m, the module run as __main__ was not imported before (a package
            # stays: python -m imports it, then runs its __main__).
            if not hasattr(sys.modules.get(req["module"]), "__path__"):
                sys.modules.pop(req["module"], None)
            sys.modules.pop(req["module"] + ".__main__", None)
            code = 0
            try:
                runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    texts = []
    for f in (out, err):
        f.seek(0); texts.append(f.read().decode(errors="replace")); f.close()
    proto.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                            "stdout": prefix[0] + texts[0], "stderr": prefix[1] + texts[1]}) + "\n")
    proto.flush()
"""


class ForkRunner:
    """Runs ``python -m module args...`` command lines by forking one warm helper process.

    ``preload``: modules the helper imports once (importing must have no side effects that a
    fresh ``python -m`` would not repeat; a study's flags are defined when it runs, not at import).
    Use as a context manager, or call `close`.
    """

    def __init__(self, preload: list[str], cwd: Path):
        self.cwd = Path(cwd)
        self._proc = None
        if hasattr(os, "fork"):
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _HELPER, json.dumps(preload)], cwd=self.cwd,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, module: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", module, *args]
        if self._proc is None:
            return subprocess.run(cmd, cwd=self.cwd, capture_output=True, text=True,
                                  timeout=timeout)
        self._proc.stdin.write(json.dumps({"module": module, "args": list(args), "timeout": timeout,
                                           "cwd": str(self.cwd)}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork helper exited (status {self._proc.wait()})")
        r = json.loads(line)
        if r["returncode"] == -signal.SIGALRM:  # the child's alarm: as subprocess.run's timeout
            raise subprocess.TimeoutExpired(cmd, timeout, r["stdout"], r["stderr"])
        return subprocess.CompletedProcess(cmd, r["returncode"], r["stdout"], r["stderr"])

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
            self._proc = None

    def __enter__(self) -> ForkRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
