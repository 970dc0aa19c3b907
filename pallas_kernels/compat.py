"""Version guards for the Pallas APIs the kernels use (JAX >= 0.10; the GPU box runs 0.11.x).

Everything version-dependent is looked up here once, by feature rather than by version number, so a
kernel module never branches on ``jax.__version__``.
"""

from __future__ import annotations

import functools

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

try:  # Triton lowering: deprecated from JAX 0.11 in favour of Mosaic GPU, may disappear later.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the installed JAX
    plgpu = None


def tpu_compiler_params(**kwargs):
    """``pltpu.CompilerParams`` (``TPUCompilerParams`` before JAX 0.7)."""
    cls = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
    return cls(**kwargs)


def gpu_compiler_params(**kwargs):
    """Triton compiler params, or None when this JAX has no Triton lowering module."""
    if plgpu is None:
        return None
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams", None)
    return None if cls is None else cls(**kwargs)


def require_triton() -> None:
    """Raises a clear error when the GPU-style kernels cannot be built on this JAX."""
    if plgpu is None or not hasattr(plgpu, "load"):
        raise ValueError(
            "this JAX has no jax.experimental.pallas.triton (with load); the GPU-style kernels "
            "need it (use impl='xla', or port the kernel to Mosaic GPU)"
        )


@functools.cache
def tpu_interpret_params(*, num_cores: int = 1, strict: bool = True):
    """TPU interpret-mode parameters (CPU simulation of SMEM/VMEM, DMAs and semaphores).

    ``strict`` turns on the checks the tests rely on: the race detector, raising on out-of-bounds
    reads and NaN-filled uninitialised scratch. Grids with a core-parallel axis need
    ``num_cores`` equal to that axis' size or the interpreter waits forever.
    """
    params = getattr(pltpu, "InterpretParams", None)
    if params is None:  # pragma: no cover - JAX < 0.6
        return True
    if not strict:
        return params(num_cores_or_threads=num_cores)
    return params(
        detect_races=True,
        out_of_bounds_reads="raise",
        uninitialized_memory="nan",
        num_cores_or_threads=num_cores,
    )


def races_found() -> bool:
    """Whether the TPU interpreter's race detector flagged a race in the last interpreted call."""
    try:  # private module: the layout changed between JAX releases, so look it up defensively
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:  # pragma: no cover
        return False
    races = getattr(ipc, "races", None)
    return bool(getattr(races, "races_found", False))


def clear_races() -> None:
    """Forgets the last interpreted call's race report (a test that makes a race on purpose
    calls this, so later checks after non-interpreted calls do not read its stale flag)."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:  # pragma: no cover
        return
    if hasattr(ipc, "races"):
        ipc.races = None


def any_memory_space():
    """Memory space for refs the kernel DMAs from itself (HBM on TPU).

    ``pl.ANY`` in JAX 0.10; looked up defensively because newer releases move memory spaces
    under ``pl.MemorySpace`` / ``pltpu.MemorySpace``.
    """
    for owner, name in ((pl, "ANY"), (getattr(pl, "MemorySpace", None), "ANY"),
                        (getattr(pltpu, "MemorySpace", None), "ANY")):  # fmt: skip
        space = getattr(owner, name, None) if owner is not None else None
        if space is not None:
            return space
    raise ValueError("this JAX exposes no ANY memory space for Pallas")  # pragma: no cover
