"""The training text of the bundled models: the Python standard library's own ``.py`` sources.

Every machine with Python has it, so the weights can be reproduced without a download. The file list
is deterministic: ``sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))``, minus any path with a
component in `EXCLUDED_DIRS` (third-party ``site-packages``, the test suites, generated data tables).
A file is held out for evaluation when ``zlib.crc32(relative_path) % EVAL_MODULUS == 0``, so the split
of a file does not depend on which other files a Python version ships.

Each document becomes ``[BOS] + utf8_bytes + [EOS]``; documents are concatenated in file order.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import numpy as np

from paged.models.tokenizer import ByteTokenizer

EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
     "encodings", "pydoc_data"}
)  # fmt: skip
EVAL_MODULUS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """Returns ``(train_files, eval_files)``, each sorted, relative to ``root``."""
    root = stdlib_root() if root is None else Path(root)
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts):
            continue
        key = zlib.crc32(rel.as_posix().encode()) % EVAL_MODULUS
        (held_out if key == 0 else train).append(rel)
    return train, held_out


def encode_files(files: list[Path], root: Path | None = None) -> np.ndarray:  # u16[total_tokens]
    """Concatenates ``[BOS] + bytes + [EOS]`` of each file into one token stream."""
    root = stdlib_root() if root is None else Path(root)
    tok = ByteTokenizer()
    parts = []
    for rel in files:
        data = np.frombuffer((root / rel).read_bytes(), np.uint8).astype(np.uint16)
        parts += [np.array([tok.bos_id], np.uint16), data, np.array([tok.eos_id], np.uint16)]
    if not parts:
        raise ValueError("no files to encode")
    return np.concatenate(parts)


def describe(num_train: int, num_eval: int, train_tokens: int, eval_tokens: int) -> str:
    return (
        f"Python {sysconfig.get_python_version()} standard library .py files under "
        f"sysconfig stdlib path, sorted, excluding dirs {sorted(EXCLUDED_DIRS)}; eval split = "
        f"crc32(relative path) % {EVAL_MODULUS} == 0 ({num_train} train files / {train_tokens} "
        f"tokens, {num_eval} eval files / {eval_tokens} tokens); byte tokens, "
        f"[BOS] doc [EOS] per file."
    )
