"""The one dtype -> tolerance table every numerical test takes its tolerances from."""

import numpy as np

# Kernels accumulate in float32; bfloat16 inputs are rounded once on the way in.
TOLERANCES = {
    np.dtype("float32"): dict(atol=2e-5, rtol=2e-5),
    np.dtype("float16"): dict(atol=2e-3, rtol=2e-3),
    "bfloat16": dict(atol=2e-2, rtol=2e-2),
}


def tol(dtype) -> dict:
    """Returns ``dict(atol=..., rtol=...)`` for ``dtype`` (numpy or jax dtype, or a name)."""
    name = np.dtype(dtype).name if str(dtype) != "bfloat16" else "bfloat16"
    if name == "bfloat16":
        return TOLERANCES["bfloat16"]
    return TOLERANCES[np.dtype(name)]
