"""``python -m paged.server``: the command line of the OpenAI-compatible server.

Usage::

    python -m paged.server --model tiny --host 127.0.0.1 --port 8000
    python -m paged.server --model tiny --max_num_seqs 64 --max_model_len 256 --attention_impl xla

Flags: every `EngineConfig` field is a flag of the same name (generated from
``dataclasses.fields(EngineConfig)``, so a new field needs no edit here). The spelling is the
field's, with underscores (``--max_num_seqs 64``); the dashed spelling (``--max-num-seqs 64``) is
accepted as an alias. Booleans take ``true/false`` (also ``1/0``, ``yes/no``), optional fields
take ``none``. Server flags: ``--host``, ``--port``, ``--served_model_name`` (default: the
model), ``--max_waiting`` (requests that may wait before 503, default 256), ``--request_timeout``
(seconds, passed to the engine per request), ``--warmup`` (compile every step a request can
select before serving, default true; `paged.engine.warmup`: progress lines, 503 with ``Retry-After``
until ready, and a small default bucket set, `paged.engine.warmup.server_buckets`), ``--api_key``
(default ``$PAGED_API_KEY``: a Bearer token every ``/v1/*`` route requires), ``--switch_interval_ms`` (the interpreter's thread switch interval, default
0.5 ms instead of Python's 5 ms, so the engine thread never waits long for the GIL while the event
loop sends chunks), ``--engine_process`` (run the engine core in a child process, `paged.server.core_process`;
default false), ``--log_level``. ``--model`` also accepts ``random-small`` (a small
random-weight model, for tests).

A bad flag or value (an unknown flag, ``--max_num_seqs 0``, ``--dtype float8``) ends in one line
on stderr naming it, exit status 2, before any model is loaded. A fatal engine error while
serving (the engine raised) is logged and ends the process with exit status 1 (`run_server`):
a server whose engine died does not stay up answering 503.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import types
import typing

from paged.config.engine_config import EngineConfig
from paged.engine.spec_decode import SpeculativeConfig
from paged.server.engines import make_engine
from paged.util import cli_lines

PROG = "paged.server"
API_KEY_ENV = "PAGED_API_KEY"  # vLLM's VLLM_API_KEY, under this project's name


def fail(message: str) -> typing.NoReturn:
    cli_lines.fail(PROG, message)


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def _parser_for(annotation) -> tuple[typing.Callable[[str], typing.Any], str]:
    """A string parser for a field's annotation, and its metavar."""
    optional = False
    t = annotation
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        optional = len(args) < len(typing.get_args(t))
        t = args[0] if len(args) == 1 else str
    base = {bool: _parse_bool, int: int, float: float, SpeculativeConfig: SpeculativeConfig.parse
            }.get(t, str)
    name = {bool: "BOOL", int: "INT", float: "FLOAT", SpeculativeConfig: "SPEC"}.get(t, "STR")

    def parse(text: str):
        if optional and text.strip().lower() in ("none", "null", ""):
            return None
        try:
            return base(text)
        except (TypeError, ValueError) as e:
            if t is SpeculativeConfig:
                raise argparse.ArgumentTypeError(str(e)) from None
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an' if name == 'INT' else 'a'} "
                                             f"{name.lower()}") from None

    return parse, name + ("|none" if optional else "")


def _flag_names(name: str) -> list[str]:
    names = [f"--{name}"]
    if "_" in name:
        names.append(f"--{name.replace('_', '-')}")
    return names


# EngineConfig fields set by a server flag of another name (one flag per setting).
SERVER_SPELLED = {"request_timeout_s": "request_timeout"}
def _choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of EngineConfig's choice fields, listed in ``--help``."""
    from paged.config import engine_config as ec
    from paged.models.registry import KNOWN_MODELS

    return {"kv_layout": ec.KV_LAYOUTS, "scheduling": ec.SCHEDULINGS, "policy": ec.POLICIES,
            "preemption_mode": ec.PREEMPTION_MODES, "attention_impl": ec.ATTENTION_IMPLS,
            "dtype": ec.DTYPES, "kv_cache_dtype": ec.KV_CACHE_DTYPES,
            "kv_scale_granularity": ec.KV_SCALE_GRANULARITIES,
            "cascade_attention": ec.CASCADE_MODES, "router": ec.ROUTERS,
            "model": (*KNOWN_MODELS, "random-small", "a checkpoint directory")}


_EXTRA_HELP = {"speculative": ": METHOD[:K] (ngram:4, draft:3) or a JSON object of "
                              "SpeculativeConfig's fields, as vLLM's --speculative-config: "
                              "'{\"method\": \"draft\", \"model\": \"DIR\", "
                              "\"num_speculative_tokens\": 4}'; none: off"}


def build_parser() -> argparse.ArgumentParser:
    p = cli_lines.OneLineParser(prog=f"python -m {PROG}", name=PROG, allow_abbrev=False,
                       description="OpenAI-compatible server over one paged.Engine.")
    server = p.add_argument_group("server")
    server.add_argument(*_flag_names("host"), default="127.0.0.1")
    server.add_argument(*_flag_names("port"), type=int, default=8000)
    server.add_argument(*_flag_names("served_model_name"), default=None,
                        help="model id in the API (default: --model)")
    server.add_argument(*_flag_names("max_waiting"), type=int, default=256,
                        help="requests that may wait before new ones get 503")
    server.add_argument(*_flag_names("request_timeout"), type=float, default=None,
                        help="seconds; a request still unfinished after it is ended "
                             "(EngineConfig.request_timeout_s)")
    server.add_argument(*_flag_names("warmup"), type=_parse_bool, default=True, metavar="BOOL",
                        help="compile every step a request can select (each step shape, plain "
                             "and with logprobs, n > 1 forks, n-gram verify steps) before "
                             "serving, printing N/N progress; until ready /health and /v1/* "
                             "answer 503 with Retry-After. The shapes: unless --min_token_bucket "
                             "or --min_seq_bucket is given, one sequence bucket (--max_num_seqs) "
                             "and two token buckets (half of and all of --max_num_batched_tokens, "
                             "capped by --max_model_len x --max_num_seqs): 4 step compilations "
                             "(20-30 s to ready on 2 CPU cores) and a small copy-on-write copy "
                             "per power of two up to --max_num_seqs; smaller --min_*_bucket "
                             "values add shapes")
    server.add_argument(*_flag_names("api_key"), default=os.environ.get(API_KEY_ENV) or None,
                        help=f"require 'Authorization: Bearer KEY' on every /v1/* route (401 "
                             f"otherwise; /health and /metrics stay open); default: the "
                             f"{API_KEY_ENV} environment variable")
    server.add_argument(*_flag_names("metrics_prefix"), default="paged", choices=("paged", "vllm"),
                        help="prefix of the /metrics names: paged (paged:num_requests_running, "
                             "...) or vllm (vllm:num_requests_running, ..., for dashboards "
                             "built on vLLM's names)")
    server.add_argument(*_flag_names("switch_interval_ms"), type=float, default=0.5,
                        help="the interpreter's thread switch interval (Python's default is 5): "
                             "how long the engine thread may wait for the GIL while the event "
                             "loop formats chunks")
    server.add_argument(*_flag_names("engine_process"), type=_parse_bool, default=False,
                        metavar="BOOL",
                        help="run the engine core in its own process (paged.server.core_process; "
                             "ZeroMQ + msgpack between them), so the HTTP event loop and the "
                             "engine's host work do not share one GIL; with "
                             "--data_parallel_size D, one process per replica, routed here")
    server.add_argument(*_flag_names("kv_events"), type=int, default=None, metavar="PORT",
                        help="publish KV cache events (vLLM's BlockStored / BlockRemoved / "
                             "AllBlocksCleared, msgpack on a ZeroMQ PUB socket, topic "
                             "kv-events) on 127.0.0.1:PORT, and replay missed batches on "
                             "PORT+1; replica i of --data_parallel_size publishes on PORT+2i "
                             "(and replays on PORT+2i+1), from its engine-core process with "
                             "--engine_process (paged.server.kv_publisher)")
    server.add_argument(*_flag_names("log_level"), default="warning",
                        choices=("critical", "error", "warning", "info", "debug"))
    engine = p.add_argument_group("engine (every EngineConfig field)")
    hints = typing.get_type_hints(EngineConfig)
    choices = _choices()
    for f in dataclasses.fields(EngineConfig):
        if f.name in SERVER_SPELLED:
            continue
        parse, metavar = _parser_for(hints[f.name])
        engine.add_argument(*_flag_names(f.name), dest=f"engine.{f.name}", type=parse,
                            default=argparse.SUPPRESS, metavar=metavar,
                            help=f"EngineConfig.{f.name} (default {f.default!r})"
                            + (f"; one of: {', '.join(choices[f.name])}"
                               if f.name in choices else "")
                            + _EXTRA_HELP.get(f.name, ""))
    return p


def parse_args(argv: list[str] | None = None):
    """``(EngineConfig, server namespace)``; exits with one line on a bad flag or value."""
    ns = build_parser().parse_args(argv)
    fields = {k.split(".", 1)[1]: v for k, v in vars(ns).items() if k.startswith("engine.")}
    if ns.port < 0 or ns.port > 65535:
        fail(f"port={ns.port} must be in [0, 65535]")
    if ns.max_waiting < 1:
        fail(f"max_waiting={ns.max_waiting} must be >= 1")
    if not (ns.switch_interval_ms > 0 and math.isfinite(ns.switch_interval_ms)):
        fail(f"switch_interval_ms={ns.switch_interval_ms} must be a finite number > 0")
    if ns.request_timeout is not None and not (ns.request_timeout > 0
                                               and math.isfinite(ns.request_timeout)):
        fail(f"request_timeout={ns.request_timeout} must be a finite number > 0")
    if ns.api_key is not None and not ns.api_key.strip():
        fail("api_key must be non-empty")
    last = 2 * fields.get("data_parallel_size", 1) - 1
    if ns.kv_events is not None and not 1 <= ns.kv_events <= 65535 - last:
        fail(f"kv_events={ns.kv_events} must be a port in [1, {65535 - last}] (replica i "
             f"publishes on PORT+2i and replays on PORT+2i+1)")
    try:
        from paged.engine.warmup import server_buckets

        config = server_buckets(EngineConfig(**fields), set(fields))
        if not ns.engine_process:  # else the core checks it: this process never starts a backend
            import jax

            from paged.config.engine_config import check_attention_impl

            check_attention_impl(config.attention_impl, jax.default_backend())
    except (TypeError, ValueError) as e:
        fail(str(e))
    return config, ns


def main(argv: list[str] | None = None) -> None:
    config, ns = parse_args(argv)
    import logging

    from paged.server.app import ServerSettings, build_app

    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Two threads want the GIL: the engine loop (short host phases between device waits) and the
    # event loop (formatting and sending chunks). With Python's default 5 ms switch interval the
    # engine thread can wait that long for the GIL after every device step.
    sys.setswitchinterval(ns.switch_interval_ms / 1000.0)
    try:
        if ns.engine_process:
            from paged.server.core_replicas import start_engine_core

            engine = start_engine_core(config, kv_events=ns.kv_events)
        else:
            engine = make_engine(config)
    except (TypeError, ValueError, FileNotFoundError, RuntimeError) as e:
        fail(str(e))
    settings = ServerSettings(served_model_name=ns.served_model_name or config.model,
                              max_waiting=ns.max_waiting, request_timeout_s=ns.request_timeout,
                              api_key=ns.api_key, warmup=ns.warmup,
                              metrics_prefix=ns.metrics_prefix,
                              kv_events_port=None if ns.engine_process else ns.kv_events)
    if ns.warmup:
        from paged.engine import warmup

        steps = warmup.plan(engine) if hasattr(engine, "_variants") else []
        print(f"{PROG}: warmup: compiling {len(steps) or 'every'} step shapes (token buckets "
              f"from {config.min_token_bucket}, sequence buckets from {config.min_seq_bucket}; "
              f"--help says which flags change them); /health answers 503 until ready",
              file=sys.stderr, flush=True)
    app = build_app(engine, settings)
    print(f"{PROG}: serving {settings.served_model_name} on http://{ns.host}:{ns.port} "
          f"(max_num_seqs={config.max_num_seqs}, max_model_len={config.max_model_len})",
          file=sys.stderr, flush=True)
    run_server(app, host=ns.host, port=ns.port, log_level=ns.log_level)


# After a fatal engine error: the seconds a graceful shutdown may take before the process ends.
FATAL_EXIT_GRACE_S = 5.0


def run_server(app, *, host: str, port: int, log_level: str = "info") -> None:
    """Serves ``app`` (`paged.server.app.build_app`) with uvicorn until SIGTERM (exit 0) or a
    fatal engine error: then every stream has got its error, the server stops and the process
    exits with status 1 (after ``FATAL_EXIT_GRACE_S`` at most), the error logged."""
    import threading
    from os import _exit as exit_now  # the documented hard exit (no cleanup), for a hung shutdown

    import uvicorn

    server = _graceful_server_class()(uvicorn.Config(app, host=host, port=port,
                                                     log_level=log_level, access_log=False))
    server.engine_loop = engine_loop = app.state.loop

    def fatal(error: BaseException) -> None:
        print(f"{PROG}: the engine failed ({type(error).__name__}: {error}); exiting with "
              f"status 1", file=sys.stderr, flush=True)
        server.should_exit = True
        timer = threading.Timer(FATAL_EXIT_GRACE_S, exit_now, (1,))  # a shutdown that hangs
        timer.daemon = True
        timer.start()

    engine_loop.on_fatal = fatal
    server.run()
    if engine_loop.error is not None:
        sys.exit(1)
    if server.terminated:
        print(f"{PROG}: shut down on SIGTERM ({server.in_flight} requests in flight were ended "
              f"with a final error event)", file=sys.stderr, flush=True)


def _graceful_server_class():
    import threading

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """SIGTERM: stop accepting, end every in-flight request (a stream gets a last
        ``data: {"error": {"code": "shutting_down"}}`` event, then ``[DONE]``; a waiting
        non-streaming request a 503), then exit 0 (uvicorn's own handling re-raises the signal:
        status 143)."""

        engine_loop = None
        terminated = False
        in_flight = 0

        def handle_exit(self, sig, frame):
            import signal

            if sig != signal.SIGTERM or self.engine_loop is None:
                return super().handle_exit(sig, frame)
            self.terminated = self.should_exit = True
            self.in_flight = self.engine_loop.num_in_flight
            threading.Thread(target=self.engine_loop.stop, daemon=True).start()

    return GracefulServer
