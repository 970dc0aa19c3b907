"""Suite-wide hygiene: compiled executables are dropped when they pile up.

The default suite compiles thousands of XLA executables in one process; each keeps JIT code
mapped in memory. Clearing JAX's caches keeps the process's memory maps and RSS bounded (a late
module otherwise compiles into an address space that earlier ones filled). Clearing after every
module, though, makes each module recompile the step shapes the previous ones already had (the
engine tests share one small model and a few shapes), so the caches are dropped only once the
process holds more than ``PAGED_TEST_MAX_RSS_GB`` GiB resident or ``PAGED_TEST_MAX_MAPS`` memory
maps (defaults 6 and 20000; 0 clears after every module, the old behaviour).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

# One persistent XLA compilation cache for the whole run: both pytest-xdist workers and every
# subprocess a test starts (servers, engine-core processes, forced-device and multi-host runs,
# study command lines) inherit these variables, so a step shape compiled once is loaded, not
# compiled again, by the others (the first tiny engine of a process: about 14 s cold, 2.6 s from
# the cache on this 2-core machine). Tracing still happens in every process, so the engines'
# trace counts (``num_compilations``) are unchanged; executables with host callbacks (Pallas
# interpret mode) are never cached by JAX. The cache lives in ``.cache/jax-tests`` of the checkout
# (git-ignored; a clean clone starts cold, a second run starts warm). ``PAGED_TEST_JAX_CACHE=0``
# turns it off, any other value moves it. Set before JAX is imported: JAX reads them at import.
_JAX_CACHE = os.environ.get(
    "PAGED_TEST_JAX_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "jax-tests"))
if _JAX_CACHE not in ("", "0"):
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    # No size bound: a bound turns on JAX's file lock, whose polling reads time.perf_counter and
    # sleeps, and under a test's patched clock (tests/test_replay.py) a contended lock made a
    # serving run's wall limit pass at once. Unlocked, a reader that meets an entry another
    # process is still writing fails to decompress it; JAX warns and compiles instead.

# The studies the tests run record results of whatever tree the suite runs in (a dirty one while
# someone works): `experiments.provenance` refuses that without --allow_dirty, which this sets.
os.environ.setdefault("EXPERIMENTS_ALLOW_DIRTY", "1")

# Cheap XLA compiles for the tests: the suite's shapes are tiny, so it spends its time compiling,
# not running (the first step of a tiny engine: 5.3 s with XLA's default CPU optimization, 3.1 s
# with the first two flags, measured interleaved on this 2-core machine; the steps after it run
# about 2x slower, a few milliseconds each). They make LLVM optimize the generated code less: the
# same program, floating-point results at most reordered in the last bits (the suite passes with
# them). The third turns off XLA:CPU's newer MLIR fusion emitters, so fusions go through the
# older elemental IR emitter, which compiles faster: three speculation and quantized-KV engine
# tests, cold, no persistent cache, 61-62 user-CPU-s with the first two flags and 38-39 with all
# three (two interleaved rounds each, this 2-core machine). The last two generate code on one
# thread and turn off the concurrency-optimized HLO scheduler (the two test workers already fill
# both cores): a tiny engine's process, its first generate included, 3.17-3.37 CPU-s without them
# and 2.73-2.99 with them (three interleaved rounds). Studies, benchmarks and library use keep XLA's defaults.
# Subprocesses a test starts inherit them; ``PAGED_TEST_XLA_FAST=0`` turns them off.
_FAST_XLA = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
             "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1",
             "--xla_cpu_enable_concurrency_optimized_scheduler=false")
if os.environ.get("PAGED_TEST_XLA_FAST", "1") != "0":
    _flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(
        _flags + [f for f in _FAST_XLA if f.split("=")[0] not in {g.split("=")[0] for g in _flags}])

import jax  # noqa: E402
import pytest  # noqa: E402

_MAX_RSS = float(os.environ.get("PAGED_TEST_MAX_RSS_GB", "6")) * 2**30
_MAX_MAPS = int(os.environ.get("PAGED_TEST_MAX_MAPS", "20000"))


def _over_limits() -> bool:
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
    except OSError:  # not Linux: clear as before
        return True
    return rss > _MAX_RSS or maps > _MAX_MAPS


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_executables():
    yield
    if _MAX_RSS <= 0 or _over_limits():
        jax.clear_caches()
        gc.collect()
        if _COMPILE_LOG:  # the profile counts them: every shape after it compiles again
            _log_file.write(json.dumps({"test": _current_test[0], "event": "clear_caches",
                                        "fun": "", "seconds": 0}) + "\n")


# Where the suite's time goes (opt-in): ``PAGED_TEST_COMPILE_LOG=<dir>`` makes every test process
# (each xdist worker; subprocesses a test starts are not covered) append one JSON line per JAX
# compile event to ``<dir>/<worker>.jsonl``: the test's node id, the event (tracing, lowering to
# MLIR, XLA compilation or persistent-cache load), the jitted function's name and the seconds,
# and one "start" line per test (which worker ran it).
# ``python -m experiments.suite_profile --compile_log=<dir>`` sums them per file and per function.
_COMPILE_LOG = os.environ.get("PAGED_TEST_COMPILE_LOG")
_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_current_test = ["<collection>"]

if _COMPILE_LOG:
    import json

    import jax.monitoring

    _log_path = Path(_COMPILE_LOG) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl"
    _log_path.parent.mkdir(parents=True, exist_ok=True)
    _log_file = open(_log_path, "a", buffering=1)  # noqa: SIM115 (open for the whole process)

    def _on_duration(event: str, duration: float, **kwargs) -> None:
        kind = _COMPILE_EVENTS.get(event)
        if kind is not None:
            _log_file.write(json.dumps({"test": _current_test[0], "event": kind,
                                        "fun": str(kwargs.get("fun_name", "?")),
                                        "seconds": round(duration, 6)}) + "\n")

    jax.monitoring.register_event_duration_secs_listener(_on_duration)

    # One "shapes" line per lowering: the jitted function and a digest of its argument shapes
    # and types (JAX's own "Compiling ..." debug message), so the profile can count distinct
    # compiled shapes per file and see which files share them; the shapes themselves are
    # written once per process and digest.
    import hashlib
    import logging

    _seen_shapes: set = set()

    class _ShapesHandler(logging.Handler):
        def emit(self, record):
            if not str(record.msg).startswith("Compiling %s with global shapes"):
                return
            fun, avals = str(record.args[0]), str(record.args[1])
            key = hashlib.sha1(avals.encode()).hexdigest()[:12]
            row = {"test": _current_test[0], "event": "shapes", "fun": fun, "seconds": 0,
                   "key": key}
            if key not in _seen_shapes:
                _seen_shapes.add(key)
                row["avals"] = avals
            _log_file.write(json.dumps(row) + "\n")

    _pxla_logger = logging.getLogger("jax._src.interpreters.pxla")
    _pxla_logger.addHandler(_ShapesHandler(logging.DEBUG))
    _pxla_logger.setLevel(logging.DEBUG)
    _pxla_logger.propagate = False  # its other debug lines stay out of pytest's log capture

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _current_test[0] = item.nodeid
        _log_file.write(json.dumps({"test": item.nodeid, "event": "start", "fun": "",
                                    "seconds": 0}) + "\n")  # which worker ran it
        yield
        _current_test[0] = "<between tests>"


# Longest files first. `make test` hands whole files to the two workers (``--dist loadfile``) in
# collection order (``--no-loadscope-reorder``; xdist's default order is most tests first, which
# put one-test subprocess files such as test_data_parallel.py last). A long file near the end
# leaves the other worker idle, so the files that took longest in a cold `make test` (measured
# with ``--durations=0``, summed per file) are collected first, in this order; the rest follow in
# their usual order. Only the order changes: every test still runs.
SLOW_FIRST = (  # the cold run of 2026-12-06 at f976a2e (experiments/results/suite_profile/)
    "test_experiments.py", "test_kv_policies.py", "test_spec_decode.py", "test_forced_devices.py",
    "test_kv_groups.py", "test_hf_checkpoints.py", "test_kv_quant_engine.py", "test_server.py",
    "test_gguf_model.py", "test_sparse_decode_engine.py", "test_kivi.py", "test_kernels_bench.py",
    "test_spec_decode_sched.py", "test_kernels_quant.py", "test_engine.py", "test_core_process.py",
    "test_kv_policies_mass.py", "test_sliding_window.py", "test_reference.py", "test_docs.py",
    "test_http_router.py", "test_routing_study.py", "test_cascade_engine.py",
    "test_page_select.py", "test_kivi_engine.py", "test_studies_memory.py",
    "test_kernels_cascade.py", "test_server_start.py", "test_models.py", "test_scan_layers.py",
    "test_quality.py", "test_kernels_paged.py", "test_multihost.py", "test_kernels_sliding.py",
    "test_trace.py", "test_sim_kv_policy.py", "test_sliding_window_study.py",
    "test_step_contract.py", "test_cache_agreement.py", "test_warmup.py",
    "test_eviction_policies.py", "test_kv_event_sockets.py", "test_overlap.py",
    "test_fragmentation.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: files stay whole
