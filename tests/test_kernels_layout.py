"""The kernel package's structure: one online softmax for every path, backend styles kept apart,
size limits."""

import ast
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import softmax

PKG = Path(__file__).resolve().parents[1] / "pallas_kernels"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("pallas_kernels")}


@pytest.mark.parametrize("style,other", [("tpu", "gpu"), ("gpu", "tpu")])
def test_no_cross_backend_imports(style, other):
    """A TPU-style module never imports a GPU-style one or vice versa; shared pieces live in
    backend-neutral modules (softmax, tiling, validation, compat)."""
    modules = [p for p in PKG.glob("*.py")
               if p.stem.endswith(f"_{style}") or p.stem == f"{style}_common"]  # fmt: skip
    assert len(modules) >= 4
    for path in modules:
        bad = [n for n in _imports(path) if n.split(".")[-1].endswith(f"_{other}")
               or f"{other}_common" in n]  # fmt: skip
        assert not bad, (path.name, bad)


def test_size_limits():
    for path in PKG.glob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 500, path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno + 1 <= 400, (path.name, node.name)


@pytest.mark.parametrize("keepdims", [False, True])
def test_online_softmax_over_tiles_is_softmax(keepdims):
    """Tile by tile, with masked keys and a row that sees nothing, the shared step and the final
    normalisation give softmax(s) @ v (zeros for the empty row); NaN in masked values is the
    caller's to zero, NaN in masked scores never leaks."""
    rng = np.random.default_rng(0)
    rows, keys, d, tile = 5, 24, 8, 8
    s = rng.standard_normal((rows, keys)).astype(np.float32)
    v = rng.standard_normal((keys, d)).astype(np.float32)
    valid = rng.random((rows, keys)) < 0.7
    valid[3] = False
    s_nan = np.where(valid, s, np.nan)
    state = softmax.initial_state((rows,), d, keepdims=keepdims)
    for lo in range(0, keys, tile):
        sl = slice(lo, lo + tile)
        state = softmax.online_softmax_step(state, jnp.asarray(s_nan[:, sl]), jnp.asarray(v[sl]),
                                            jnp.asarray(valid[:, sl]))  # fmt: skip
    m, lsum, acc = state
    assert m.shape == ((rows, 1) if keepdims else (rows,))
    got = np.asarray(softmax.normalize(lsum, acc), np.float64)
    e = np.where(valid, np.exp(s - np.where(valid, s, -np.inf).max(1, keepdims=True)), 0.0)
    want = (e / np.maximum(e.sum(1, keepdims=True), 1e-30)) @ v.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert np.all(got[3] == 0)


def test_merge_partials_matches_one_pass():
    """Split-K: states over disjoint key ranges, merged, equal the state over all keys."""
    rng = np.random.default_rng(1)
    s = jnp.asarray(rng.standard_normal((2, 4, 32)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 32, 16)), jnp.float32)
    valid = jnp.ones(s.shape, bool).at[:, :, 16:].set(False)  # the second split sees nothing

    def run(lo, hi):
        return softmax.online_softmax_step(softmax.initial_state((2, 4), 16), s[..., lo:hi],
                                           v[:, lo:hi], valid[..., lo:hi])  # fmt: skip

    parts = [run(0, 16), run(16, 32)]  # (m, l, acc) each
    o, m, lsum = (jnp.stack([p[i] for p in parts]) for i in (2, 0, 1))
    merged = softmax.merge_partials(o, m, lsum)
    whole = run(0, 32)
    np.testing.assert_allclose(merged, softmax.normalize(whole[1], whole[2]), rtol=1e-6, atol=1e-6)
