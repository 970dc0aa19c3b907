"""What every study shares: the command line, config checks, output folders, progress, provenance.

A study is ``experiments/<name>.py`` with a config ``experiments/configs/<name>.py`` and ends in::

    if __name__ == "__main__":
        common.run("name", main, check)

`run` defines ``--config`` (file, ``:variant`` and ``--config.key=value`` overrides), parses the
command line, calls ``check(config)`` (which validates every setting and builds what is cheap to
build: engine configs, workloads), then ``main(config, plan)`` with what ``check`` returned. A
mistyped key, a value of the wrong type or out of range, an unknown variant or flag: one line on
stderr naming the key, the value and what is allowed (the closest valid keys for a typo), exit
status 2, before any model is loaded.

A ``:smoke`` variant (tiny shapes, few requests, often no warmup: the first arm pays the
compilations) is a plumbing check, not a measurement: `run` says so in one line before and after
the study, and every result it writes carries ``"smoke": true`` (in ``provenance`` and at the top
of a payload that has one).

Outputs go to ``config.output_dir``, by default ``results/<study>/<UTC timestamp>/`` (git-ignored;
`output_dir`). Progress is `Progress`: a bar with rate and ETA on a terminal, one summary line per
loop off a terminal.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments import provenance as _provenance
from experiments.configs.engine_fields import (  # noqa: F401  (re-exported for the studies)
    STUDY_LEVEL_FIELDS,
    closest,
    engine_config_dict,
    make_engine_config,
)
from paged.util.progress_bar import Progress  # noqa: F401  (the one progress helper, used by the studies)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
USAGE_EXIT = 2  # exit status of a command-line or config mistake
SMOKE_NOTE = ("smoke run: a plumbing check (tiny shapes, few requests, timings may include "
              "compilation), not a measurement; do not read or cite its numbers")
_RUN = {"smoke": False}  # set by `run` from the config variant


def is_smoke() -> bool:
    """Whether this process runs a study's ``:smoke`` variant (`run` sets it)."""
    return _RUN["smoke"]


# --- the command line --------------------------------------------------------------------------
class ConfigError(ValueError):
    """A config value that a study's ``check`` refuses (the message names the key)."""


def run(study: str, main: Callable[[Any, Any], Any], check: Callable[[Any], Any] | None = None,
        *, default_config: str | None = None) -> None:
    """Parses the command line, checks the config, then runs ``main(config, check(config))``.

    Args:
      study: the study's name (``experiments/configs/<study>.py`` is the default config, and error
        lines start with ``<study>:``).
      main: ``main(config, plan)``; ``plan`` is what ``check`` returned (None without ``check``).
      check: ``check(config) -> plan``; raises ValueError / TypeError / KeyError (or OSError for
        a missing file) naming the key.
      default_config: ``--config``'s default (path, optionally ``:variant``).
    """
    from absl import app, flags
    from ml_collections import config_flags

    default = default_config or str(CONFIG_DIR / f"{study}.py")
    holder: dict[str, Any] = {}

    def parse(argv: list[str]) -> list[str]:
        try:
            # Defined here, not at import: importing a study has no side effects, and a bad
            # override (which config_flags reads from argv as soon as the flag exists) is caught.
            holder["flag"] = config_flags.DEFINE_config_file(
                "config", default, f"{study} config (experiments/configs/{study}.py[:variant]).",
                lock_config=True)
            define_allow_dirty()
            rest = flags.FLAGS(argv)
            holder["flag"].value.keys()  # raises if the config file failed to load
        except Exception as e:  # noqa: BLE001  (every parse failure becomes one line)
            fail(study, describe_parse_error(e, argv, default))
        if len(rest) > 1:
            fail(study, f"unexpected arguments {rest[1:]}; settings are --config.<key>=<value>")
        return rest

    def wrapped(argv):
        config = holder["flag"].value
        try:
            plan = check(config) if check is not None else None
        except (ValueError, TypeError, KeyError, OSError) as e:
            fail(study, _message(e))
        begin_run(study)
        _RUN["smoke"] = _config_spec(sys.argv, default).rpartition(":")[2] == "smoke"
        if _RUN["smoke"]:
            print(f"{study}: {SMOKE_NOTE}", flush=True)
        main(config, plan)
        if _RUN["smoke"]:
            print(f"{study}: {SMOKE_NOTE}", flush=True)

    app.run(wrapped, flags_parser=parse)


def define_allow_dirty() -> None:
    """Defines ``--allow_dirty`` (every study has it: `run` and the studies with their own
    ``main`` call this)."""
    from absl import flags

    if "allow_dirty" not in flags.FLAGS:
        flags.DEFINE_bool("allow_dirty", _provenance.env_allows_dirty(), "record a result of uncommitted code (the diff "
                          "is stored beside the JSON as <name>.diff); refused otherwise")


def begin_run(study: str) -> None:
    """Captures the code state once, at the start; exits 2 (`fail`) on a dirty tree without
    ``--allow_dirty``."""
    from absl import flags

    try:
        _provenance.begin_run(bool(flags.FLAGS["allow_dirty"].value))
    except _provenance.DirtyTreeError as e:
        fail(study, str(e))


def fail(study: str, message: str) -> None:
    """Exits with ``<study>: <message>`` as one line on stderr (status 2)."""
    print(f"{study}: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT)


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return str(e) or type(e).__name__


def load_config_file(spec: str):
    """``get_config(variant)`` of a config file given as ``path[:variant]``."""
    path, _, variant = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_study_config", path)
    if module_spec is None or not Path(path).is_file():
        raise FileNotFoundError(f"no config file {path!r}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()


def flat_keys(config, prefix: str = "") -> list[str]:
    """Every dotted key of a ConfigDict (inner dicts and leaves)."""
    keys = []
    for k in config.keys():
        v = config[k]
        keys.append(prefix + k)
        if hasattr(v, "keys") and hasattr(v, "to_dict"):
            keys += flat_keys(v, prefix + k + ".")
    return keys


def _lookup(config, dotted: str):
    """``(found, parent, leaf)`` for a dotted key."""
    node, parts = config, dotted.split(".")
    for i, part in enumerate(parts):
        if not (hasattr(node, "keys") and part in node.keys()):
            return False, None, None
        if i == len(parts) - 1:
            return True, node, part
        node = node[part]
    return False, None, None


def _overrides(argv: list[str]) -> list[tuple[str, str]]:
    out = []
    for i, arg in enumerate(argv):
        for lead in ("--config.", "-config.", "--noconfig.", "-noconfig."):
            if arg.startswith(lead):
                key, eq, value = arg[len(lead):].partition("=")
                if not eq and i + 1 < len(argv) and not lead.startswith(("--no", "-no")):
                    value = argv[i + 1]
                out.append((key, value))
    return out


def _config_spec(argv: list[str], default: str) -> str:
    spec = default
    for i, arg in enumerate(argv):
        if arg.startswith(("--config=", "-config=")):
            spec = arg.split("=", 1)[1]
        elif arg in ("--config", "-config") and i + 1 < len(argv):
            spec = argv[i + 1]
    return spec


def describe_parse_error(error: BaseException, argv: list[str], default: str) -> str:
    """One line saying which part of the command line is wrong and what is allowed."""
    from absl import flags

    if isinstance(error, flags.UnrecognizedFlagError):
        return f"unknown flag --{error.flagname}; settings are --config.<key>=<value>"
    spec = _config_spec(argv, default)
    try:
        config = load_config_file(spec)
    except Exception as e:  # noqa: BLE001
        return f"--config={spec}: {_message(e)}"
    keys = flat_keys(config)
    for key, value in _overrides(argv):
        found, parent, leaf = _lookup(config, key)
        if not found:
            leaf = key.rsplit(".", 1)[-1]
            if leaf in STUDY_LEVEL_FIELDS:  # engine.model: the study names its model itself
                return (f"unknown config key {key!r} (in --config.{key}={value}): the {leaf} "
                        f"is a study-level key, use --config.{leaf}={value}")
            near = closest(key, keys) or closest(leaf, keys)
            hint = f"; closest: {', '.join(near)}" if near else ""
            return f"unknown config key {key!r} (in --config.{key}={value}){hint}"
        if f"config.{key}=" in str(error) or f"config.{key}:" in str(error):
            kind = _type_name(parent, leaf)
            return f"{key}={value!r} must be {'an' if kind[:1] in 'aeiou' else 'a'} {kind}"
    return _message(error).splitlines()[0] if _message(error) else type(error).__name__


def _type_name(parent, leaf: str) -> str:
    try:
        t = parent.get_type(leaf)
        return getattr(t, "__name__", str(t))
    except Exception:  # noqa: BLE001
        return "value"


# --- checks shared by the studies ----------------------------------------------------------------
def check_model(name: str) -> str:
    """``name`` if it is a bundled model, ``"random-small"``, a packaged GGUF model or ``.gguf``
    file, or a Hugging Face checkpoint directory (its ``config.json`` checked); ValueError
    otherwise."""
    from paged.models.gguf import is_gguf_path
    from paged.models.hf import is_checkpoint_dir
    from paged.models.hf_config import read_hf_config
    from paged.models.registry import KNOWN_MODELS

    known = ("random-small", *KNOWN_MODELS)
    if is_checkpoint_dir(name):
        read_hf_config(name)
    elif is_gguf_path(name):  # a packaged model ("smollm2-135m") or a .gguf file
        return name
    elif name not in known:
        raise ValueError(f"model={name!r} must be one of {known} or a checkpoint directory "
                         "(config.json + safetensors)")
    return name


def check_positive(**values: Any) -> None:
    """Each ``key=value`` must be a number > 0 (names are the config keys)."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{key}={value!r} must be a number > 0")


def check_unset(engine, keys, by: str) -> None:
    """Engine fields a study sets per arm or point must not also be set in ``config.engine``."""
    for key in keys:
        if key in engine and engine[key] is not None:
            raise ValueError(f"engine.{key}={engine[key]!r} is set per arm by {by}; "
                             f"change {by} instead")


# --- outputs ---------------------------------------------------------------------------------------
def named_pair(item, where: str, what: str) -> tuple[str, dict]:
    """``(name, dict)`` from a config's ``(name, {key: value})`` entry; ``ValueError`` naming
    ``where`` (e.g. ``rows[2]``) and ``what`` the dict holds otherwise."""
    try:
        name, values = item
        return name, dict(values)
    except (TypeError, ValueError):
        raise ValueError(f"{where}={item!r} must be a (name, {{{what}: value}}) pair") from None


def spread(values) -> dict:
    """Median, min, max and count of the values that are not None (all None: ``None`` each)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": float(statistics.median(vals)), "min": min(vals), "max": max(vals), "n": len(vals)}


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def results_dir(study: str, base: str | None = None) -> Path:
    """``results/<study>/<UTC timestamp>/`` (git-ignored), created."""
    path = Path(base or "results") / study / utc_stamp()
    path.mkdir(parents=True, exist_ok=True)
    return path


def output_dir(config, study: str) -> Path:
    """Where a study writes: ``config.output_dir``, or ``results/<study>/<UTC timestamp>/``."""
    path = Path(config.output_dir) if config.output_dir else results_dir(study)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path | str, payload: dict) -> Path:
    """A plain JSON file (a plot's data, a replay input); a study's result goes through
    `write_result`. In a smoke run a payload with ``provenance`` gets ``"smoke": true`` first."""
    if _RUN["smoke"] and isinstance(payload, dict) and "provenance" in payload:
        payload = {"smoke": True, **payload}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=jsonable) + "\n")
    return path


def write_result(path: Path | str, payload: dict, *, inputs=()) -> Path:
    """The one results writer: ``payload`` with its provenance (`experiments.provenance`: code
    state captured at the start, environment); a dirty run's diff beside it as ``<name>.diff``.
    A post-processing step names the files it read in ``inputs`` (their sha256 and commits go
    into the provenance) and never edits them. A smoke run's result says so: ``"smoke": true``
    first and in its provenance."""
    if _RUN["smoke"] and isinstance(payload, dict):
        extra = payload.get("provenance") if isinstance(payload.get("provenance"), dict) else {}
        payload = {"smoke": True, **payload, "provenance": {**extra, "smoke": True}}
    return _provenance.write_result(path, payload, inputs=inputs)


jsonable = _provenance.jsonable  # the one JSON encoding of numpy values and ConfigDicts


# --- progress --------------------------------------------------------------------------------------
def quiet_matplotlib() -> None:
    """Call before importing matplotlib: its log lines (the font-cache notice that a first use
    prints) are dropped below ERROR."""
    logging.getLogger("matplotlib").setLevel(logging.ERROR)


# --- provenance ------------------------------------------------------------------------------------
def provenance() -> dict:
    """Code state and environment stored with every result (`experiments.provenance.record`),
    and whether this run is a smoke run (a plumbing check, not a measurement)."""
    return {**_provenance.record(), "smoke": _RUN["smoke"]}


def load_model(name: str):
    """``(config, params)`` of a bundled model, of "random-small" (random weights, for smoke runs)
    or of a Hugging Face checkpoint directory (float32, `paged.models.load_checkpoint`)."""
    from paged.models.config import LlamaConfig
    from paged.models.gguf import is_gguf_path
    from paged.models.hf import is_checkpoint_dir, load_checkpoint
    from paged.models.registry import init_params, load_any
    from paged.models.registry import load_model as load_bundled

    if is_checkpoint_dir(name):
        return load_checkpoint(name)
    if is_gguf_path(name):  # a packaged model or a .gguf file (`load_any`: layers stacked)
        return load_any(name)[:2]
    if name == "random-small":
        cfg = LlamaConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                          ffn_dim=128)
        return cfg, init_params(cfg, 0)
    return load_bundled(name)
