"""The drop-in example of WORKSPACE.md runs as written."""

import re
from pathlib import Path


def test_workspace_example_runs():
    text = (Path(__file__).resolve().parents[1] / "WORKSPACE.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "WORKSPACE.md lost its example"
    exec(compile(blocks[0], "WORKSPACE.md", "exec"), {})
