"""Argument validators shared by the whole package.

Each function checks one value and returns it normalised (a Python ``int`` / ``float`` /
``bool`` / ``str`` / ``list[int]``), or raises with a message that names the argument, shows the
value and says what is allowed:

- ``TypeError`` when the value has the wrong type (``True`` is not an integer, ``2.0`` is not an
  integer, ``"no"`` is not a boolean, ``"1.5"`` is not a number);
- ``ValueError`` when it has the right type but is out of range (negative, non-finite, too large
  for float32, not one of the allowed names).

Rules that hold everywhere: ``bool`` is never accepted as a number (it is an ``int`` subclass, but
``max_num_seqs=True`` is a bug, not a request for one sequence); numbers must be finite unless a
caller opts out, and floats must fit in float32 because sampling parameters and times may end up
in float32 device arrays, where an overflow turns silently into ``inf``.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1


def _type_name(value: Any) -> str:
    return type(value).__name__


def integer(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
            allow_none: bool = False) -> int | None:
    """``value`` as a Python int: a Python or numpy integer, never ``bool`` nor a float.

    Raises:
      TypeError: not an integer (``None`` only passes with ``allow_none``).
      ValueError: below ``minimum`` or above ``maximum`` (both inclusive).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        none = " or None" if allow_none else ""
        raise TypeError(f"{name}={value!r} must be an integer{none} (not bool or float), "
                        f"got {_type_name(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        kind = ("a positive integer" if minimum == 1 else
                "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}")
        raise ValueError(f"{name}={value} must be {kind}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value} must be <= {maximum}")
    return value


def real(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
         exclusive: bool = False, allow_none: bool = False, allow_inf: bool = False) -> float | None:
    """``value`` as a Python float: any real number (int, float, numpy scalar), never ``bool``.

    Args:
      minimum: lower bound; inclusive unless ``exclusive`` (then ``value > minimum``).
      maximum: upper bound, inclusive.
      allow_inf: accept ``+-inf`` (still subject to the bounds). NaN is never accepted, and a
        finite value must fit in float32 (``abs(value) <= FLOAT32_MAX``).

    Raises:
      TypeError: not a real number (``None`` only passes with ``allow_none``).
      ValueError: NaN, infinite (unless ``allow_inf``), too large for float32, or out of bounds.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        none = " or None" if allow_none else ""
        raise TypeError(f"{name}={value!r:.80} must be a real number{none}, got {_type_name(value)}")
    try:
        x = float(value)
    except OverflowError:  # an int beyond float64
        raise ValueError(f"{name}={value!r:.40} is too large: must fit in float32 "
                         f"(|x| <= {FLOAT32_MAX:.4g})") from None
    if math.isnan(x):
        raise ValueError(f"{name}={value!r} must be a number, not NaN")
    if math.isinf(x):
        if not allow_inf:
            raise ValueError(f"{name}={value!r} must be finite")
    elif abs(x) > FLOAT32_MAX:
        raise ValueError(f"{name}={value!r:.40} is too large: must fit in float32 "
                         f"(|x| <= {FLOAT32_MAX:.4g})")
    if minimum is not None and (x <= minimum if exclusive else x < minimum):
        raise ValueError(f"{name}={value!r} must be {'>' if exclusive else '>='} {minimum}")
    if maximum is not None and x > maximum:
        raise ValueError(f"{name}={value!r} must be <= {maximum}")
    return x


def boolean(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool`` (or numpy bool); no truthiness: ``"no"`` and ``1`` are refused.

    Raises:
      TypeError: anything else.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r:.80} must be True or False, got {_type_name(value)}")
    return bool(value)


def one_of(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    """``value`` if it equals one of ``allowed`` (and has its type: ``1`` is not ``"1"``).

    Raises:
      ValueError: not one of ``allowed`` (listed in the message).
    """
    allowed = tuple(allowed)
    if not any(isinstance(value, type(a)) and value == a for a in allowed):
        raise ValueError(f"{name}={value!r:.80} must be one of {allowed}")
    return value


def string(name: str, value: Any, *, allow_empty: bool = False) -> str:
    """``value`` if it is a ``str`` (non-empty unless ``allow_empty``).

    Raises:
      TypeError: not a str.
      ValueError: empty.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r:.80} must be a str, got {_type_name(value)}")
    if not value and not allow_empty:
        raise ValueError(f"{name}={value!r} must be a non-empty str")
    return value


def token_ids(name: str, value: Any, *, limit: int | None = None,
              allow_empty: bool = False) -> list[int]:
    """``value`` as a list of Python ints: a flat sequence of integers or a 1-D integer array.

    Nothing is coerced: floats (even ``2.0``), bools, strings, nested lists and arrays of other
    dtypes or ranks are refused, so a malformed prompt is never silently turned into other tokens.

    Args:
      limit: token ids must be in ``[0, limit)`` (e.g. the vocabulary size); ``None``: ``>= 0``.

    Raises:
      TypeError: not a sequence / 1-D integer array, or an element that is not an integer.
      ValueError: empty (unless ``allow_empty``), a 2-D or deeper array, or an id out of range.
    """
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got an array of shape {value.shape}")
        if not (np.issubdtype(value.dtype, np.integer) or (value.size == 0 and allow_empty)):
            raise TypeError(f"{name} must hold integer token ids, got an array of dtype "
                            f"{value.dtype}")
        ids = value.tolist()
    elif isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of integer token ids, got {_type_name(value)}")
    else:
        ids = list(value)
        for i, t in ([] if set(map(type, ids)) <= {int} else enumerate(ids)):  # fast: all ints
            if type(t) is not int:
                if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
                    raise TypeError(f"{name}[{i}]={t!r:.40} is not an integer token id "
                                    f"(got {_type_name(t)})")
                ids[i] = int(t)
    if not ids and not allow_empty:
        raise ValueError(f"{name} is empty")
    if ids and min(ids) >= 0 and (limit is None or max(ids) < limit):
        return ids
    bad = [t for t in ids if t < 0 or (limit is not None and t >= limit)]
    if bad:
        where = f"[0, {limit})" if limit is not None else ">= 0"
        raise ValueError(f"{name} has token ids {bad[:5]} outside {where}")
    return ids


def closest(name: str, options) -> list[str]:
    """Up to three of ``options`` closest to ``name`` (difflib), best first."""
    return difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)


def known_keys(what: str, given: Iterable[str], options: Iterable[str]) -> None:
    """Raises TypeError for the first of ``given`` not in ``options``, naming the closest ones
    (the studies' wording: ``...; closest: a, b``)."""
    options = list(options)
    for key in given:
        if key not in options:
            hint = closest(key, options)
            raise TypeError(f"{what} has no field {key!r}"
                            + (f"; closest: {', '.join(hint)}" if hint else ""))
