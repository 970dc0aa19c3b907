"""The package's structure: no module reads another object's private fields, no import cycles,
and the engine and the simulator compose the same host core.

The private-field scan reads every module of ``paged/``, ``pallas_kernels/`` and
``experiments/`` (AST, no imports): an attribute ``x._name`` is allowed when ``x`` is ``self`` /
``cls`` / ``super()``, or when the module itself defines ``_name`` (a class reading the same
field of another instance of itself). Anything else is a missing seam.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("paged", "pallas_kernels", "experiments")


def _modules(packages=PACKAGES):
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _own_private_names(tree: ast.AST) -> set[str]:
    """Private names the module defines: functions, classes, ``self._x`` fields, class-level
    and module-level ``_x`` assignments, ``__slots__`` entries."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
                    if t.id == "__slots__" and node.value is not None:
                        names.update(c.value for c in ast.walk(node.value)
                                     if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in names if n.startswith("_")}


# Standard-library names that start with an underscore and are public by documentation.
STDLIB_PRIVATE = {"os._exit", "sys._getframe"}


def private_reads(packages=PACKAGES) -> list[str]:
    """``file:line: expression`` of every read of another object's private field."""
    found = []
    for path, tree in _modules(packages):
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            if node.attr in own or ast.unparse(node) in STDLIB_PRIVATE:
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def import_cycles(package: str = "paged") -> list[list[str]]:
    """Strongly connected components (size > 1) of the package's import graph, counting imports
    anywhere in a module (function-level ones too). ``from pkg import sub`` of a submodule is an
    arrow to ``pkg.sub`` alone: a package's face (its ``__init__``) may re-export its modules."""
    mods = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
                graph[m].update(subs)
                if node.module in mods and len(subs) < len(node.names):
                    graph[m].add(node.module)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods)
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_reads_another_objects_private_fields():
    assert private_reads() == []


def test_the_scan_sees_a_private_read(tmp_path, monkeypatch):
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "a.py").write_text("class A:\n    def __init__(self):\n        self._x = 1\n\n"
                              "    def same(self, other):\n        return other._x\n")
    (pkg / "b.py").write_text("def peek(engine):\n    return engine._requests\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert private_reads(("demo",)) == ["demo/b.py:2: engine._requests"]


@pytest.mark.parametrize("package", ["paged", "experiments"])
def test_no_import_cycles_in_the_package(package):
    assert import_cycles(package) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from demo.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from demo import a\n")
    (pkg / "c.py").write_text("import demo.a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert import_cycles("demo") == [["demo.a", "demo.b"]]


@pytest.mark.parametrize("which", ["engine", "sim"])
def test_engine_and_simulator_compose_one_host_core(which):
    from engine_utils import small_model

    from paged import Engine, EngineConfig
    from paged.sim.replica import SimReplica
    from paged.sim.roofline import RooflineStepModel
    from paged.sim.specs import H200, LLAMA3_8B
    from paged.step.host_core import HostCore

    cfg = EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
                       max_model_len=64, attention_impl="xla")
    if which == "engine":
        model_config, params = small_model()
        obj = Engine(cfg, model_config=model_config, params=params)
    else:
        obj = SimReplica(cfg, RooflineStepModel(H200, LLAMA3_8B, block_size=8))
    core = obj.core
    assert isinstance(core, HostCore)
    assert core.reader.ib is core.batch and core.reader.bm is core.block_manager
    assert core.scheduler.batch is core.batch
    assert obj.block_manager is core.block_manager


def test_kv_format_names_agree_with_the_kernels():
    from paged.config import engine_config
    from pallas_kernels import quant
    assert engine_config.KV_CACHE_DTYPES == ("auto", *quant.QUANT_DTYPES)
    assert engine_config.KV_SCALE_GRANULARITIES == quant.GRANULARITIES


HOST_MODULES = ("paged.config", "paged.request.outputs", "paged.kv.block_manager",
                "paged.kv.group_manager", "paged.step.scheduler", "paged.step.cascade_plan",
                "paged.fleet.routing", "paged.fleet.handover", "paged.workload", "paged.accounting")


def test_host_modules_import_no_jax():
    import subprocess
    import sys
    code = ("import importlib, sys\n"
            f"for m in {HOST_MODULES!r}:\n"
            "    importlib.import_module(m)\n"
            "print(sorted(m for m in ('jax', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# Sizes as smoke detectors: a file, class or function past these sizes holds more than one job.
MAX_FILE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 500, 400, 100
SIZED_PACKAGES = ("paged", "pallas_kernels")
# Nothing is exempt; a new exemption needs its reason here.
OVERSIZE_ALLOWED: set[str] = set()


def oversize(packages=SIZED_PACKAGES) -> dict[str, str]:
    """``{"path" or "path::name": "N lines > limit"}`` of every file, class and function (methods
    and nested functions included) longer than its limit."""
    found = {}
    for path, tree in _modules(packages):
        rel = str(path.relative_to(ROOT))
        n = len(path.read_text().splitlines())
        if n > MAX_FILE_LINES:
            found[rel] = f"{n} lines > {MAX_FILE_LINES}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                found[f"{rel}::{node.name}"] = f"{n} lines > {limit}"
    return found


def test_no_file_class_or_function_is_oversize():
    found = oversize()
    assert {k: v for k, v in found.items() if k not in OVERSIZE_ALLOWED} == {}, \
        "split by job (a part per job, as paged/kv/blocks/)"
    assert sorted(OVERSIZE_ALLOWED - found.keys()) == [], \
        "within the limits now: remove these entries from OVERSIZE_ALLOWED"


def test_the_size_scan_sees_an_oversize_function(tmp_path, monkeypatch):
    pkg = tmp_path / "demo"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "a.py").write_text(f"class A:\n    def ok(self):\n        pass\n\n\ndef f():\n{body}")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert oversize(("demo",)) == {"demo/a.py::f": f"{MAX_FUNCTION_LINES + 1} lines > "
                                                   f"{MAX_FUNCTION_LINES}"}

# --- the support matrix has one home ---------------------------------------------------------
# The settings a refusal of a pair of mechanisms names (paged.config.support's mechanisms, by
# the words their messages use). A raise elsewhere naming two of them is a pair decided outside
# the table.
MECHANISM_WORDS = {
    "kv_cache_dtype": r"kv_cache_dtype", "kv_layout": r"kv_layout",
    "scheduling": r"(?<![a-z_])scheduling=", "prefix caching": r"enable_prefix_caching",
    "preemption_mode": r"preemption_mode", "async_scheduling": r"async_scheduling",
    "speculative": r"speculative|method='(draft|ngram)'", "host tier": r"host_kv_cache_bytes",
    "prefill_replicas": r"prefill_replicas", "data_parallel_size": r"data_parallel_size",
    "tensor_parallel_size": r"tensor_parallel_size", "cascade": r"cascade_attention",
    "windows": r"sliding_window|sliding-window|sliding layers|every layer slides",
    "kv groups": r"KV-cache groups", "processes": r"(span|spanning|across) processes|in one process",
    "engine processes": r"engine-core process",
}
# file: words of a raise that names two settings but decides no pair of mechanisms.
PAIR_RAISE_ALLOWED = {
    # P < D is a bound between two counts, not two mechanisms.
    "paged/config/engine_config.py": ("prefill_replicas", "data_parallel_size"),
    # D x T devices against the devices there are.
    "paged/engine/placement.py": ("data_parallel_size", "tensor_parallel_size"),
    # the draft model's KV heads against T (a fact of the draft checkpoint).
    "paged/engine/spec_decode.py": ("speculative", "tensor_parallel_size"),
}


def _raise_text(node: ast.Raise) -> str:
    """The string parts of a ``raise ValueError(...)``'s message (f-string constants joined)."""
    exc = node.exc
    if not (isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name)
            and exc.func.id == "ValueError" and exc.args):
        return ""
    return "".join(c.value for c in ast.walk(exc.args[0])
                   if isinstance(c, ast.Constant) and isinstance(c.value, str))


def pair_raises(packages=("paged",)) -> list[str]:
    """``file:line: settings`` of every ValueError outside ``paged/config/support.py`` whose
    message names two mechanisms' settings (``PAIR_RAISE_ALLOWED`` excepted)."""
    import re

    found = []
    for path, tree in _modules(packages):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "paged/config/support.py":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise):
                continue
            text = _raise_text(node)
            named = tuple(k for k, w in MECHANISM_WORDS.items() if re.search(w, text))
            if len(named) >= 2 and set(named) != set(PAIR_RAISE_ALLOWED.get(rel, ())):
                found.append(f"{rel}:{node.lineno}: {named}")
    return found


def test_pairs_of_mechanisms_are_refused_only_by_the_support_matrix():
    assert pair_raises() == []


def test_the_pair_scan_sees_a_pair_raise(tmp_path, monkeypatch):
    pkg = tmp_path / "paged"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f(c):\n    raise ValueError(f'cascade_attention={c} needs "
                              "prefill_replicas=0')\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert len(pair_raises()) == 1
