"""What every experiment records beside its numbers: versions, devices, git revision, output dir."""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np


def git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        rev = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).resolve().parent).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict:
    """Environment facts stored with every result."""
    return {
        "git_revision": git_revision(),
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "platform": platform.platform(),
        "argv": sys.argv,
        "utc_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _jaxlib_version() -> str | None:
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def results_dir(study: str, base: str | None = None) -> Path:
    """``results/<study>/<UTC timestamp>/`` (git-ignored), created."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = Path(base or "results") / study / stamp
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path | str, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=_jsonable) + "\n")
    return path


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if hasattr(x, "to_dict"):
        return x.to_dict()
    return str(x)


def load_model(name: str):
    """``(config, params)`` of a bundled model, or of "random-small" (random weights, for smoke runs)."""
    from paged.models.config import LlamaConfig
    from paged.models.registry import init_params
    from paged.models.registry import load_model as load_bundled

    if name == "random-small":
        cfg = LlamaConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                          ffn_dim=128)
        return cfg, init_params(cfg, 0)
    return load_bundled(name)
