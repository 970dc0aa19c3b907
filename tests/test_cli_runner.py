"""`cli_runner.ForkRunner` gives what ``subprocess.run([python, "-m", ...])`` gives: exit status,
stdout and stderr apart, the module run as ``__main__`` from ``cwd``, a timeout, and the
helper's own import-time output in front of every run's."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli_runner import ForkRunner


def test_fork_runner_reports_like_subprocess_run(tmp_path):
    pkg = tmp_path / "clipkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "noisy.py").write_text("import sys\nprint('import noise', file=sys.stderr)\n")
    (pkg / "tool.py").write_text(
        "import sys\n"
        "if __name__ == '__main__':\n"
        "    print('out', *sys.argv[1:])\n"
        "    print('err', file=sys.stderr)\n"
        "    open('ran.txt', 'w').write(__name__)\n"
        "    sys.exit(int(sys.argv[1]))\n")
    (pkg / "boom.py").write_text("raise RuntimeError('boom')\n")
    (pkg / "slow.py").write_text("import time\ntime.sleep(30)\n")
    with ForkRunner(["clipkg.noisy", "clipkg.tool"], tmp_path) as cli:
        for code in (0, 3):
            got = cli.run("clipkg.tool", str(code))
            want = subprocess.run([sys.executable, "-m", "clipkg.tool", str(code)], cwd=tmp_path,
                                  capture_output=True, text=True)
            assert (got.returncode, got.stdout) == (want.returncode, want.stdout) == (
                code, f"out {code}\n")
            # The helper's import printed once; every run shows it, as a fresh start would.
            assert got.stderr == "import noise\nerr\n" and want.stderr == "err\n"
            assert (tmp_path / "ran.txt").read_text() == "__main__"
        boom = cli.run("clipkg.boom")
        assert boom.returncode == 1 and "RuntimeError: boom" in boom.stderr
        assert "Traceback" in boom.stderr
        with pytest.raises(subprocess.TimeoutExpired):
            cli.run("clipkg.slow", timeout=1)
        assert cli.run("clipkg.tool", "0").returncode == 0  # the helper outlives a timeout
