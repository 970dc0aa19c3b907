"""One jitted call instead of many eager operations, for the kernel and reference tests.

Called eagerly, a jnp function compiles each primitive once per new shape (a reference attention:
about a hundred XLA compiles of 0.01-0.02 s each); `jit_call` traces the whole function once per
shape and compiles one program. Same inputs, same function: the outputs differ at most in the
last float32 bits (XLA may fuse and reorder), within every test's tolerance. The engine runs
these functions jitted too; eager use keeps its own tests (argument checks raise before tracing).
"""

from __future__ import annotations

import functools

import jax
import numpy as np


@functools.cache
def _jitted(fn, static: tuple[str, ...]):
    return jax.jit(fn, static_argnames=static)


def _is_static(value) -> bool:
    """A keyword value without array leaves (numbers, strings, None, configs) is static."""
    return not any(isinstance(x, (np.ndarray, jax.Array))
                   for x in jax.tree_util.tree_leaves(value))


def jit_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` as one jitted call: positional arguments and array-valued keyword
    arguments are traced, every other keyword argument is static (compiled into the program;
    name scalars that select shapes or paths, such as ``page_size=`` or ``impl=``, this way).
    The jitted ``fn`` is kept per set of static names, so a shape compiles once per test process."""
    static = tuple(sorted(k for k, v in kwargs.items() if _is_static(v)))
    return _jitted(fn, static)(*args, **kwargs)
