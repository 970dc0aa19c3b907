"""The docs stay true to the code: their examples run, every path, module and name they cite
exists, every `make` command is a target, and WORKSPACE.md stays a map (at most 15 KB).

Runnable examples are fenced as ```python; illustrations that need a server or undefined names
are fenced as ```py and are not run.
"""

import importlib
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", ROOT / "WORKSPACE.md", ROOT / "experiments" / "README.md",
     *(ROOT / "docs").glob("*.md")]
)
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in DOCS}

# Pages every map must have (issue 39, item 7; issue 46, item 6).
REQUIRED_PAGES = (
    "paging-and-prefix-cache", "scheduling", "speculation", "quantized-kv", "windows-and-groups",
    "host-tier", "disaggregation", "cascade", "simulator", "serving", "replay-and-evidence",
    "use-the-ops",
)

# A repository path: starts at a top-level folder or file of the repository.
PATH_RE = re.compile(r"(?<![\w./-])((?:paged|pallas_kernels|experiments|tests|docs|\.ci)/[\w./*-]*)")
MODULE_RE = re.compile(r"python3? -m ([\w.]+)")
DOTTED_RE = re.compile(r"`((?:paged|pallas_kernels)(?:\.\w+)+)")
LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def _examples():
    for name, text in PAGES.items():
        if name in ("README.md", "WORKSPACE.md") or name.startswith("docs/"):
            for i, block in enumerate(_python_blocks(text)):
                yield pytest.param(name, block, id=f"{name}#{i}")


def test_required_pages_exist():
    missing = [p for p in REQUIRED_PAGES if f"docs/{p}.md" not in PAGES]
    assert not missing, missing


def test_workspace_is_a_map():
    size = (ROOT / "WORKSPACE.md").stat().st_size
    assert size <= 15 * 1024, f"WORKSPACE.md is {size} bytes; move details into docs/"


def test_use_the_ops_has_a_tested_example():
    blocks = _python_blocks(PAGES["docs/use-the-ops.md"])
    assert blocks and any("paged_attention" in b and "assert_allclose" in b for b in blocks)


@pytest.mark.parametrize("name,block", list(_examples()))
def test_example_runs(name, block):
    exec(compile(block, name, "exec"), {"__name__": "__docs__"})


def test_every_path_exists():
    missing = []
    for name, text in PAGES.items():
        for path in PATH_RE.findall(text):
            path = path.rstrip(".,:;")
            if "*" in path:  # a glob names the files it stands for
                if not list(ROOT.glob(path)):
                    missing.append((name, path))
            elif not (ROOT / path).exists():
                missing.append((name, path))
    assert not missing, missing


def test_workspace_package_table_names_real_files():
    """The package table names files relative to its row's package: they exist too."""
    missing = []
    for line in PAGES["WORKSPACE.md"].splitlines():
        row = re.match(r"\| `(paged/\w+/)`", line)
        if not row:
            continue
        for name in re.findall(r"`([\w/]+(?:\.py|/))`", line):
            if not name.startswith(("paged/", "pallas_kernels/")) and not (ROOT / row[1] / name).exists():
                missing.append((row[1], name))
    assert not missing, missing


def test_every_study_is_in_the_studies_readme():
    text = PAGES["experiments/README.md"]
    studies = sorted(p.stem for p in (ROOT / "experiments" / "configs").glob("*.py")
                     if p.stem not in ("__init__", "engine_fields"))
    assert studies
    missing = [s for s in studies if f"`{s}`" not in text and f"experiments.{s} " not in text]
    assert not missing, missing
    for name in re.findall(r"^- `(\w+)`", text, flags=re.M):
        assert (ROOT / "experiments" / f"{name}.py").exists(), name


def test_every_markdown_link_exists():
    missing = []
    for name, text in PAGES.items():
        base = (ROOT / name).parent
        for link in LINK_RE.findall(text):
            if "://" in link:
                continue
            if not (base / link).exists():
                missing.append((name, link))
    assert not missing, missing


def test_every_python_m_module_exists():
    missing = []
    for name, text in PAGES.items():
        for module in MODULE_RE.findall(text):
            module = module.rstrip(".")
            if importlib.util.find_spec(module) is None:
                missing.append((name, module))
    assert not missing, missing


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_resolves():
    missing = sorted({(name, d) for name, text in PAGES.items() for d in DOTTED_RE.findall(text)
                      if not _resolves(d)})
    assert not missing, missing


def test_every_make_command_in_the_readme_is_a_target():
    targets = set(re.findall(r"^make ([\w-]+)", PAGES["README.md"], flags=re.M))
    assert {"install", "test"} <= targets
    for t in sorted(targets):  # a dry run: the target exists (nothing is built)
        proc = subprocess.run(["make", "-n", t], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, (t, proc.stderr)


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\b", PAGES["README.md"], flags=re.M)


def test_no_stale_facts():
    """Facts issue 46 found stale: the study model key, num_compilations as a call, a fixed
    test count."""
    for name, text in PAGES.items():
        assert "config.engine.model=" not in text, name  # the model is config.model
        assert "num_compilations()" not in text, name  # a property
        assert not re.search(r"\b1,0\d\d tests", text), name  # say "about 1,600 tests"


def test_combinations_page_lists_the_support_matrix():
    """docs/combinations.md names every mechanism and every refused pair of paged/config/support.py."""
    from paged.config import support

    text = PAGES["docs/combinations.md"]
    assert not [m for m in support.MECHANISMS if f"`{m}`" not in text]
    assert not [(r.a, r.b) for r in support.REFUSED if f"| {r.a} | {r.b} |" not in text]
