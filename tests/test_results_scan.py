"""Every committed result outside ``experiments/results/archive/`` identifies its code, carries its
evidence label and sits beside a README that says how it was made and what it is compared with.

Per JSON: an evidence label (``real`` / ``constructed`` / ``simulated``, or a dict of such labels
per input, as `paged.workload.evidence` defines them); a ``provenance`` dict with a revision,
devices and a UTC time; the revision is a commit in the history (skipped in a shallow checkout)
and contains the script the recorded command ran; a dirty run written by the current writer has
its ``.diff`` beside it. Per folder holding a JSON: a README.md (there or in an enclosing result
folder) naming the JSON, a command, a date and an anchor. A ``replay.json`` is a replay input
written beside its study's result (which carries the provenance), not a result of its own.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from paged.workload.evidence import EVIDENCE

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
ARCHIVE = RESULTS / "archive"
COMPANIONS = ("replay.json",)  # replay inputs, written beside a result that has the provenance


def _results() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*.json")
                  if ARCHIVE not in p.parents and p.name not in COMPANIONS)


def _rel(p: Path) -> str:
    return p.relative_to(RESULTS).as_posix()


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


def _is_git() -> bool:
    return _git("rev-parse", "--git-dir").returncode == 0


def _shallow() -> bool:
    return _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"


RESULT_FILES = _results()


def test_there_are_results():
    assert len(RESULT_FILES) > 20, "experiments/results/ lost its results?"


def _evidence_problem(label) -> str | None:
    if isinstance(label, dict):
        bad = {k: v for k, v in label.items() if v not in EVIDENCE}
        return f"evidence per input {bad} must be one of {EVIDENCE}" if bad or not label else None
    return None if label in EVIDENCE else f"evidence={label!r} must be one of {EVIDENCE}"


def _revision(prov: dict) -> str | None:
    rev = prov.get("git_commit") or prov.get("git_revision")
    return rev.split("-")[0].split(" ")[0] if isinstance(rev, str) and rev else None


def _script(prov: dict) -> str | None:
    argv = prov.get("argv") or []
    m = re.search(r"experiments/([A-Za-z0-9_]+)\.py$", argv[0]) if argv else None
    return f"experiments/{m.group(1)}.py" if m else None


@pytest.mark.parametrize("path", RESULT_FILES, ids=_rel)
def test_label_and_provenance(path):
    body = json.loads(path.read_text())
    assert isinstance(body, dict), f"{_rel(path)}: not a JSON object"
    problem = _evidence_problem(body.get("evidence"))
    assert problem is None, f"{_rel(path)}: {problem}"
    prov = body.get("provenance")
    assert isinstance(prov, dict), f"{_rel(path)}: no provenance dict"
    missing = [k for k in ("devices", "utc_time") if not prov.get(k)]
    assert _revision(prov) not in (None, "unknown"), f"{_rel(path)}: no revision"
    assert not missing, f"{_rel(path)}: provenance lacks {missing}"
    if prov.get("git_diff_file"):  # the current writer: a dirty run stores its diff beside it
        assert (path.parent / prov["git_diff_file"]).is_file(), \
            f"{_rel(path)}: dirty run without its {prov['git_diff_file']}"
    assert not (prov.get("git_dirty") and not prov.get("git_diff_file")) \
        or "git_commit" not in prov, f"{_rel(path)}: dirty run recorded without a diff file"


@pytest.mark.parametrize("path", RESULT_FILES, ids=_rel)
def test_revision_in_history_and_holds_the_study(path):
    if not _is_git():
        pytest.skip("not a git checkout: the recorded revisions cannot be looked up")
    prov = json.loads(path.read_text())["provenance"]
    rev = _revision(prov)
    if _git("cat-file", "-e", f"{rev}^{{commit}}").returncode != 0:
        if _shallow():
            pytest.skip(f"shallow checkout: {rev} may be older than its history (git fetch "
                        "--unshallow to check it)")
        pytest.fail(f"{_rel(path)}: revision {rev} is not a commit in this history")
    script = _script(prov)
    if script is not None:
        assert _git("cat-file", "-e", f"{rev}:{script}").returncode == 0, (
            f"{_rel(path)}: revision {rev} does not contain {script}, the code that ran")


def _readme_for(folder: Path) -> Path | None:
    """The README of ``folder`` or of the nearest enclosing result folder."""
    while True:
        if (folder / "README.md").is_file():
            return folder / "README.md"
        if folder == RESULTS:
            return None
        folder = folder.parent


FOLDERS = sorted({p.parent for p in RESULT_FILES})


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: _rel(f) or ".")
def test_readme_names_command_date_and_anchor(folder):
    readme = _readme_for(folder)
    assert readme is not None, f"{_rel(folder) or 'experiments/results'}: no README.md"
    text = readme.read_text()
    where = readme.relative_to(RESULTS).as_posix()
    assert re.search(r"python -m experiments\.|bash experiments/", text), \
        f"{where}: no command (python -m experiments.<study> ...)"
    assert re.search(r"20\d\d-\d\d-\d\d", text), f"{where}: no date (YYYY-MM-DD)"
    assert re.search(r"(?im)^#+ .*anchor", text), f"{where}: no '## Anchor' section"
    for path in RESULT_FILES:
        if path.parent == folder:
            name = path.relative_to(readme.parent).as_posix()
            assert name in text or (path.parent != readme.parent
                                    and path.parent.relative_to(readme.parent).as_posix() in text), \
                f"{where} does not mention {name}"


def test_archive_says_why():
    assert (ARCHIVE / "README.md").is_file()
    text = (ARCHIVE / "README.md").read_text()
    for path in sorted(ARCHIVE.iterdir()):
        if path.name != "README.md":
            assert f"`{path.name}" in text, f"archive/README.md does not say why {path.name} is there"
