"""The drop-in example of WORKSPACE.md runs as written."""

import re
from pathlib import Path


def test_workspace_example_runs():
    text = (Path(__file__).resolve().parents[1] / "WORKSPACE.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "WORKSPACE.md lost its example"
    exec(compile(blocks[0], "WORKSPACE.md", "exec"), {})


def test_every_make_command_in_the_readme_is_a_target():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    targets = set(re.findall(r"^make ([\w-]+)", (root / "README.md").read_text(), flags=re.M))
    assert {"install", "run", "test"} <= targets
    for t in sorted(targets):  # a dry run: the target exists (nothing is built)
        proc = subprocess.run(["make", "-n", t], cwd=root, capture_output=True, text=True)
        assert proc.returncode == 0, (t, proc.stderr)
