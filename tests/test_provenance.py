"""The one results writer (`experiments.provenance`): a clean tree is recorded, a dirty one or an
untracked source file is refused without ``allow_dirty``, and with it the diff lands beside the
JSON. Each test builds its own small git repository (the suite's checkout may be dirty)."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from experiments import provenance


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "paged").mkdir(parents=True)
    (root / "experiments" / "results").mkdir(parents=True)
    (root / "paged" / "a.py").write_text("x = 1\n")
    (root / "README.md").write_text("docs\n")
    _git(root, "init", "-q")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "first")
    return root


def test_clean_tree_is_recorded(repo):
    out = provenance.write_result(repo / "experiments/results/r.json", {"evidence": "real"},
                                  allow_dirty=False, root=repo)
    prov = json.loads(out.read_text())["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                          text=True).stdout.strip()
    assert prov["git_commit"] == head and prov["git_revision"] == head
    assert prov["git_dirty"] is False and prov["untracked_source"] == []
    assert prov["git_describe"] == head[:len(prov["git_describe"])]
    for key in provenance.REQUIRED_FIELDS:
        assert key in prov, key
    assert not (repo / "experiments/results/r.diff").exists()
    # The result itself (under experiments/results/) does not make the next run dirty.
    provenance.write_result(repo / "experiments/results/r2.json", {}, allow_dirty=False, root=repo)


def test_dirty_tree_refused_without_flag_and_diff_stored_with_it(repo):
    (repo / "paged" / "a.py").write_text("x = 2\n")
    target = repo / "experiments/results/r.json"
    with pytest.raises(provenance.DirtyTreeError, match="--allow_dirty"):
        provenance.write_result(target, {"evidence": "real"}, allow_dirty=False, root=repo)
    assert not target.exists()
    provenance.write_result(target, {"evidence": "real"}, allow_dirty=True, root=repo)
    prov = json.loads(target.read_text())["provenance"]
    assert prov["git_dirty"] is True and prov["git_revision"].endswith("-dirty")
    assert prov["git_describe"].endswith("-dirty") and prov["git_diff_file"] == "r.diff"
    diff = (repo / "experiments/results/r.diff").read_text()
    assert "-x = 1" in diff and "+x = 2" in diff
    assert prov["git_diff_sha256"]


def test_untracked_source_listed_and_refused(repo):
    (repo / "paged" / "new.py").write_text("y = 3\n")
    (repo / "notes.txt").write_text("not source\n")  # outside the source folders: ignored
    (repo / "experiments/results/old.json").write_text("{}\n")  # results: not source
    state = provenance.code_state(repo)
    assert state["untracked_source"] == [
        {"path": "paged/new.py", "sha256": hashlib.sha256(b"y = 3\n").hexdigest()}]
    assert state["git_dirty"] is True and state["diff"] == ""
    with pytest.raises(provenance.DirtyTreeError, match="paged/new.py"):
        provenance.write_result(repo / "experiments/results/r.json", {}, allow_dirty=False,
                                root=repo)
    out = provenance.write_result(repo / "experiments/results/r.json", {}, allow_dirty=True,
                                  root=repo)
    prov = json.loads(out.read_text())["provenance"]
    assert [u["path"] for u in prov["untracked_source"]] == ["paged/new.py"]
    assert "=== untracked paged/new.py" in (repo / "experiments/results/r.diff").read_text()


def test_docs_change_is_not_a_code_change(repo):
    (repo / "README.md").write_text("docs, edited\n")
    assert provenance.code_state(repo)["git_dirty"] is False


def test_study_extras_kept_and_completed(repo):
    out = provenance.write_result(repo / "experiments/results/r.json",
                                  {"provenance": {"seed": 3}, "x": 1}, allow_dirty=False, root=repo)
    body = json.loads(out.read_text())
    assert body["x"] == 1 and body["provenance"]["seed"] == 3 and body["provenance"]["utc_time"]


def test_no_checkout_takes_git_rev(tmp_path, monkeypatch):
    (tmp_path / "paged").mkdir()
    (tmp_path / "paged" / "a.py").write_text("x = 1\n")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("GIT_REV", raising=False)
    state = provenance.code_state(tmp_path)
    assert state["git_checkout"] is False and state["git_dirty"] is None
    with pytest.raises(provenance.DirtyTreeError, match="no git checkout"):
        provenance.check_clean(state, allow_dirty=False)
    monkeypatch.setenv("GIT_REV", "abc123")
    state = provenance.code_state(tmp_path)
    assert state["git_commit"] == "abc123" and len(state["source_sha256"]) == 64
    provenance.check_clean(state, allow_dirty=False)  # the operator named the commit


def test_post_processing_names_its_inputs(repo):
    first = provenance.write_result(repo / "experiments/results/a.json", {"x": 1},
                                    allow_dirty=False, root=repo)
    out = provenance.write_result(repo / "experiments/results/b.json", {"y": 2}, allow_dirty=False,
                                  root=repo, inputs=[first])
    (src,) = json.loads(out.read_text())["provenance"]["derived_from"]
    assert src["sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()
    assert src["git_commit"] == json.loads(first.read_text())["provenance"]["git_commit"]
