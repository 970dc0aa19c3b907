"""The one results writer: every study's JSON carries the code that produced it and where it ran.

`code_state` reads the checkout: ``git describe --always --dirty`` (git's own view: any tracked
file, docs included, makes it ``-dirty``), the full commit, the diff of tracked changes and the
untracked files (with sha256) under the source folders (`SOURCE_DIRS`, ``experiments/results/``
left out; ``git_dirty`` and the refusal look only at those). `write_result` writes a study's JSON
with `record` (that code state plus JAX version, devices, UTC time, load average, Python version)
under ``"provenance"``; a dirty tree or an untracked source file is refused (`DirtyTreeError`)
unless ``allow_dirty``, and then the diff is stored beside the JSON as ``<name>.diff`` (untracked
files' contents appended). ``EXPERIMENTS_ALLOW_DIRTY=1`` in the environment is the flag's default
(the test suite sets it for the studies it runs). `begin_run` captures the state once at a study's
start (``common.run`` calls it with ``--allow_dirty``), so the record names the code that
started, not what was on disk at the end.

Outside a git checkout (a tree copied to a device) the commit comes from the ``GIT_REV``
environment variable and cannot be checked; ``source_sha256`` (one hash over every source file)
lets a reviewer compare the tree with a commit later.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("paged", "pallas_kernels", "experiments", "tests")
EXCLUDED_DIRS = ("experiments/results",)
SOURCE_FILES = ("pyproject.toml",)
REQUIRED_FIELDS = ("git_describe", "git_commit", "git_dirty", "untracked_source", "jax_version",
                   "devices", "utc_time", "load_average", "python_version")


class DirtyTreeError(RuntimeError):
    """A run of uncommitted code without ``--allow_dirty``."""


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _pathspecs() -> list[str]:
    return [*SOURCE_DIRS, *SOURCE_FILES, *(f":(exclude){d}" for d in EXCLUDED_DIRS)]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _source_files(root: Path) -> list[Path]:
    files = [root / f for f in SOURCE_FILES if (root / f).is_file()]
    for d in SOURCE_DIRS:
        for p in (root / d).rglob("*"):
            rel = p.relative_to(root).as_posix()
            if (p.is_file() and "__pycache__" not in p.parts
                    and not any(rel.startswith(e + "/") for e in EXCLUDED_DIRS)):
                files.append(p)
    return sorted(files)


def source_sha256(root: Path | str = REPO_ROOT) -> str:
    """One sha256 over the source folders' files (path and content, sorted by path)."""
    root, h = Path(root), hashlib.sha256()
    for p in _source_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def code_state(root: Path | str = REPO_ROOT) -> dict[str, Any]:
    """What code is in ``root``: describe, commit, whether it is dirty, the tracked diff (text,
    key ``diff``; not stored in the JSON) and the untracked source files with their sha256."""
    root = Path(root)
    commit = _git(root, "rev-parse", "HEAD")
    if commit is None:  # not a checkout (a tree copied to a device)
        rev = os.environ.get("GIT_REV", "")
        return {"git_describe": f"{rev} (from GIT_REV, unchecked)" if rev else "unknown",
                "git_commit": rev or "unknown", "git_dirty": None, "git_checkout": False,
                "untracked_source": [], "diff": "", "source_sha256": source_sha256(root)}
    diff = _git(root, "diff", "HEAD", "--binary", "--", *_pathspecs()) or ""
    listed = _git(root, "ls-files", "--others", "--exclude-standard", "--", *_pathspecs()) or ""
    untracked = [{"path": p, "sha256": _sha256(root / p)}
                 for p in sorted(listed.splitlines()) if (root / p).is_file()]
    describe = (_git(root, "describe", "--always", "--dirty") or "").strip()
    return {"git_describe": describe, "git_commit": commit.strip(),
            "git_dirty": bool(diff.strip()) or bool(untracked), "git_checkout": True,
            "untracked_source": untracked, "diff": diff, "source_sha256": source_sha256(root)}


def check_clean(state: dict, allow_dirty: bool) -> None:
    """Raises `DirtyTreeError` for a dirty tree (or one not known to be clean) unless
    ``allow_dirty``."""
    if allow_dirty or state["git_dirty"] is False:
        return
    if state["git_dirty"] is None:
        why = "no git checkout here, so the code cannot be identified"
        if state["git_commit"] != "unknown":
            return  # GIT_REV names the commit; source_sha256 lets anyone check it later
    else:
        n_diff = state["diff"].count("\ndiff --git") + state["diff"].startswith("diff --git")
        why = (f"{n_diff} changed tracked file(s) and {len(state['untracked_source'])} untracked "
               "source file(s) (" + ", ".join(u["path"] for u in state["untracked_source"][:3])
               + ")" if state["untracked_source"] else f"{n_diff} changed tracked file(s)")
    raise DirtyTreeError(f"refusing to record a result of uncommitted code: {why}; commit first, "
                         "or pass --allow_dirty (the diff is then stored beside the JSON)")


def environment() -> dict[str, Any]:
    """Where it ran: JAX version, devices, UTC time, load average, Python, platform, argv."""
    try:
        import jax

        jax_version, backend = jax.__version__, jax.default_backend()
        devices = [str(d) for d in jax.devices()]
    except Exception as e:  # noqa: BLE001  (no JAX, or no backend: say so in the record)
        jax_version, backend, devices = f"unavailable: {type(e).__name__}", None, []
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"jax_version": jax_version, "backend": backend, "devices": devices,
            "utc_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average": load, "python_version": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "argv": list(sys.argv)}


def jsonable(x):
    """JSON for numpy scalars and arrays, ConfigDicts (``to_dict``), anything else as ``str``."""
    if hasattr(x, "tolist"):  # numpy scalars and arrays
        return x.tolist()
    if hasattr(x, "to_dict"):
        return x.to_dict()
    return str(x)


_RUN: dict[str, Any] = {}  # the state begin_run captured: {"state": ..., "allow_dirty": ...}


def begin_run(allow_dirty: bool, root: Path | str = REPO_ROOT) -> dict:
    """Captures the code state at a study's start and refuses a dirty one without
    ``allow_dirty`` (`DirtyTreeError`); `record` and `write_result` then use it."""
    state = code_state(root)
    check_clean(state, allow_dirty)
    _RUN.update(state=state, allow_dirty=allow_dirty, root=Path(root))
    return state


def env_allows_dirty() -> bool:
    """``EXPERIMENTS_ALLOW_DIRTY=1``: ``--allow_dirty``'s default (the test suite sets it)."""
    return os.environ.get("EXPERIMENTS_ALLOW_DIRTY", "") == "1"


def _current(root: Path | str | None, allow_dirty: bool | None) -> tuple[dict, bool]:
    if root is None and _RUN:
        return _RUN["state"], _RUN["allow_dirty"] if allow_dirty is None else allow_dirty
    return code_state(root or REPO_ROOT), env_allows_dirty() if allow_dirty is None else allow_dirty


def record(root: Path | str | None = None) -> dict[str, Any]:
    """The ``"provenance"`` dict: the code state (without the diff text) and the environment.
    ``git_revision`` (the commit, ``-dirty`` appended when dirty) is kept for older readers."""
    state, _ = _current(root, None)
    out = {k: v for k, v in state.items() if k != "diff"}
    out["git_revision"] = state["git_commit"] + ("-dirty" if state["git_dirty"] else "")
    out["git_diff_sha256"] = hashlib.sha256(state["diff"].encode()).hexdigest() \
        if state["git_dirty"] else None
    return {**out, **environment()}


def diff_text(state: dict, root: Path | str) -> str:
    """The tracked diff, then each untracked source file's content (a reader can rebuild the
    tree from the commit)."""
    parts = [state["diff"]]
    for u in state["untracked_source"]:
        try:
            body = (Path(root) / u["path"]).read_text(errors="replace")
        except OSError as e:
            body = f"(unreadable: {e})"
        parts.append(f"\n=== untracked {u['path']} sha256 {u['sha256']}\n{body}")
    return "".join(parts)


def derived_from(paths) -> list[dict]:
    """Each input file of a post-processing step: its path, sha256 and the commit its own
    provenance records (None when it records none)."""
    out = []
    for p in paths:
        p = Path(p)
        data = p.read_bytes()
        try:
            prov = json.loads(data).get("provenance") or {}
        except (ValueError, AttributeError):
            prov = {}
        out.append({"path": str(p), "sha256": hashlib.sha256(data).hexdigest(),
                    "git_commit": prov.get("git_commit") or prov.get("git_revision")})
    return out


def write_result(path: Path | str, payload: dict, *, allow_dirty: bool | None = None,
                 root: Path | str | None = None, inputs=()) -> Path:
    """Writes ``payload`` as JSON at ``path`` with its provenance; returns the path.

    ``payload["provenance"]`` (if the study put extra facts there) is kept and completed with
    `record`. A dirty tree raises `DirtyTreeError` unless ``allow_dirty`` (default: what
    `begin_run` was given); a dirty run's diff goes to ``<path without .json>.diff``. Written
    atomically (a kill mid-write leaves the previous version). ``inputs``: the files a
    post-processing step read (never edited: it writes its own file), recorded as
    ``provenance["derived_from"]`` (`derived_from`).
    """
    path = Path(path)
    state, allowed = _current(root, allow_dirty)
    check_clean(state, allowed)
    extra = payload.get("provenance") if isinstance(payload.get("provenance"), dict) else {}
    prov = {**extra, **record(root)}
    if inputs:
        prov["derived_from"] = derived_from(inputs)
    if state["git_dirty"]:
        diff_path = path.with_suffix(".diff")
        prov["git_diff_file"] = diff_path.name
    body = {**payload, "provenance": prov}
    path.parent.mkdir(parents=True, exist_ok=True)
    if state["git_dirty"]:
        diff_path.write_text(diff_text(state, root or _RUN.get("root", REPO_ROOT)))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=2, default=jsonable) + "\n")
    os.replace(tmp, path)
    return path
