"""The ``engine`` part of every study config, generated from `paged.EngineConfig`'s fields.

Every field of `EngineConfig` (except ``model``: a study names its model at ``config.model``, which
also accepts ``"random-small"``) appears in ``config.engine`` with its default and its annotated
type, so ``--config.engine.<field>=<value>`` works in every study, and a field added to
`EngineConfig` needs no edit here or in any study.

A field whose default is ``None`` (``num_blocks: int | None``) becomes an ml_collections placeholder
of the annotated type, so ``--config.engine.num_blocks=129`` parses as an int. A study that sets a
field per arm or per point (``kv_layout`` per serving arm, ``block_size`` per swept size) passes it
as ``None``: the key still exists (a typo is still caught) and `make_engine_config` fills it, or uses
`EngineConfig`'s default when nothing does.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from paged.config.engine_config import EngineConfig, check_attention_impl
from paged.util import validate

# Set at the study's top level (``config.model``), not in ``config.engine``.
STUDY_LEVEL_FIELDS = ("model",)


def _base_type(annotation: Any, default: Any) -> type:
    """The class an override must parse to: ``int | None`` -> int, ``tuple[int, ...]`` -> tuple."""
    t = annotation
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        t = args[0] if len(args) == 1 else object
    t = typing.get_origin(t) or t
    if not isinstance(t, type):  # Literal[...] and friends: fall back to the default's type
        t = type(default) if default is not None else object
    return t


def engine_fields() -> dict[str, tuple[type, Any]]:
    """``{name: (type, default)}`` of every `EngineConfig` field a study config carries."""
    hints = typing.get_type_hints(EngineConfig)
    out = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name in STUDY_LEVEL_FIELDS or not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        out[f.name] = (_base_type(hints.get(f.name, object), default), default)
    return out


def engine_config_dict(**overrides: Any) -> ml_collections.ConfigDict:
    """``config.engine`` for a study: every `EngineConfig` field, typed, with its default.

    Args:
      **overrides: the study's own defaults; ``None`` leaves a field unset (a placeholder of the
        field's type) for the study to set per arm or point.

    Raises:
      KeyError: an override that is not an `EngineConfig` field.
    """
    fields = engine_fields()
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise KeyError(f"not EngineConfig fields: {unknown}; known: {sorted(fields)}")
    e = ml_collections.ConfigDict()
    for name, (kind, default) in fields.items():
        value = overrides.get(name, default)
        if value is None:
            e[name] = config_dict.placeholder(kind)
        elif kind is float and isinstance(value, int) and not isinstance(value, bool):
            e[name] = float(value)
        else:
            e[name] = value
    return e


closest = validate.closest  # one implementation, shared with EngineConfig's keyword check


def make_engine_config(engine: Mapping | ml_collections.ConfigDict, *, model: str | None = None,
                       where: str = "engine", check_backend: bool = True,
                       **overrides: Any) -> EngineConfig:
    """The `EngineConfig` that ``config.engine`` (plus a study's per-arm ``overrides``) describes.

    Args:
      engine: ``config.engine`` (a ConfigDict or a plain mapping).
      model: the study's ``config.model``; set as ``EngineConfig.model`` unless it is
        ``"random-small"`` (random weights that the study passes to the engine itself).
      where: how error messages name the source of the values (``"engine"`` for ``config.engine``).
      check_backend: also check that ``attention_impl`` runs on JAX's default backend.
      **overrides: per-arm or per-point values; they win over ``engine``.

    Raises:
      ValueError / TypeError: an unknown field or a bad value; the message starts with
        ``<where>.<field>=<value>`` and says what is allowed.
    """
    values = engine.to_dict() if hasattr(engine, "to_dict") else dict(engine)
    fields = engine_fields()
    for key in list(values) + list(overrides):
        if key not in fields:
            hint = closest(key, fields)
            extra = " (the model is config.model)" if key in STUDY_LEVEL_FIELDS else ""
            raise ValueError(f"{where}.{key} is not an engine setting{extra}"
                             + (f"; closest: {', '.join(hint)}" if hint else ""))
    values.update(overrides)
    hints = typing.get_type_hints(EngineConfig)
    kwargs = {}
    for key, value in values.items():
        optional = type(None) in typing.get_args(hints.get(key))
        if value is None and not optional:
            continue  # unset per-arm field: EngineConfig's default
        if key == "kv_policy" and isinstance(value, Mapping):  # KVPolicyConfig's fields
            from paged.config.kv_policy import KVPolicyConfig

            value = KVPolicyConfig(**value)
        kwargs[key] = value
    if model is not None and model != "random-small":
        kwargs["model"] = model
    try:
        cfg = EngineConfig(**kwargs)
        if check_backend:
            import jax

            check_attention_impl(cfg.attention_impl, jax.default_backend())
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}.{e}") from None
    return cfg
