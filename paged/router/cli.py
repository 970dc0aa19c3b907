"""``python -m paged.router``: the command line of the HTTP router.

Usage::

    python -m paged.router --backend http://127.0.0.1:8000 --backend http://127.0.0.1:8001 \\
        --host 127.0.0.1 --port 8080 --policy prefix_aware --load_threshold 16

Flags (underscores as spelled here, dashes accepted too, as ``paged.server``'s): ``--backend URL``
(repeat it; ``http://`` or ``https://`` with a host, at least one, no duplicates), ``--host``,
``--port``, ``--policy`` (``prefix_aware`` default, ``round_robin``, ``least_loaded``),
``--load_threshold`` (requests; ``prefix_aware`` keeps the prefix winner while its load is at most
the least-loaded backend's plus this), ``--metrics_interval`` (seconds between scrapes of each
backend's ``/metrics``, default 1), ``--connect_timeout`` (seconds, default 5),
``--request_timeout`` (seconds per forwarded request, default none), ``--max_tree_chars``
(characters of each backend's prefix tree, default 4 Mi), ``--prefix_granularity`` (characters
a hit is counted in, default 16), ``--log_level``.

A bad flag or value ends in one line on stderr naming it, exit status 2. Backends need not be up
when the router starts: one that does not answer is marked down until its ``/metrics`` does.
"""

from __future__ import annotations

import argparse
import math
import sys
import typing
import urllib.parse

from paged.fleet.routing import POLICIES
from paged.util import cli_lines

PROG = "paged.router"


def fail(message: str) -> typing.NoReturn:
    cli_lines.fail(PROG, message)


def _names(name: str) -> list[str]:
    return [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])


def _optional_float(text: str) -> float | None:
    if text.strip().lower() in ("none", "null", ""):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def check_url(url: str) -> str:
    """``url`` without a trailing slash; `fail` unless it is ``http(s)://host[:port][/path]``."""
    u = urllib.parse.urlsplit(url.strip())
    try:
        u.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        fail(f"--backend {url!r}: bad port")
    if u.scheme not in ("http", "https") or not u.hostname:
        fail(f"--backend {url!r} must be an http:// or https:// URL with a host "
             f"(e.g. http://127.0.0.1:8000)")
    if u.query or u.fragment:
        fail(f"--backend {url!r} must not have a query or fragment")
    return url.strip().rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = cli_lines.OneLineParser(prog=f"python -m {PROG}", name=PROG, allow_abbrev=False,
                       description="Prefix-aware router over several paged.server instances.")
    p.add_argument(*_names("backend"), action="append", default=[], metavar="URL",
                   help="a paged.server's base URL (repeat for each backend)")
    p.add_argument(*_names("host"), default="127.0.0.1")
    p.add_argument(*_names("port"), type=int, default=8080)
    p.add_argument(*_names("policy"), default="prefix_aware", choices=POLICIES,
                   help="paged.fleet.routing.Router's policy (default prefix_aware)")
    p.add_argument(*_names("load_threshold"), type=int, default=16, metavar="INT",
                   help="prefix_aware: keep the prefix winner while its load is at most the "
                        "least-loaded backend's plus this many requests")
    p.add_argument(*_names("metrics_interval"), type=float, default=1.0, metavar="SECONDS",
                   help="seconds between scrapes of each backend's /metrics")
    p.add_argument(*_names("connect_timeout"), type=float, default=5.0, metavar="SECONDS",
                   help="a backend that takes longer to accept a connection is marked down")
    p.add_argument(*_names("request_timeout"), type=_optional_float, default=None,
                   metavar="SECONDS|none", help="seconds to wait for a backend's response")
    p.add_argument(*_names("max_tree_chars"), type=int, default=1 << 22, metavar="INT",
                   help="characters of routed prompts kept per backend (LRU)")
    p.add_argument(*_names("prefix_granularity"), type=int, default=16, metavar="INT",
                   help="a prefix hit counts in whole multiples of this many characters")
    p.add_argument(*_names("kv_events"), action="append", default=[], metavar="tcp://HOST:PORT",
                   help="a backend's KV event endpoint (its paged.server --kv_events PORT; "
                        "replays from PORT+1); one per --backend, in the same order: route on "
                        "the backends' true prefix caches instead of the approximate trees")
    p.add_argument(*_names("tokenizer"), default=None, metavar="MODEL",
                   help="with --kv_events: the backends' model (a bundled name such as tiny, or "
                        "a checkpoint directory), to encode text completion prompts for routing "
                        "(without it, only token-id prompts are routed on the caches)")
    p.add_argument(*_names("log_level"), default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    return p


def parse_args(argv: list[str] | None = None):
    """``(backend URLs, RouterSettings, namespace)``; exits with one line on a bad flag or value."""
    ns = build_parser().parse_args(argv)
    if not ns.backend:
        fail("at least one --backend URL is required")
    urls = [check_url(u) for u in ns.backend]
    dup = next((u for i, u in enumerate(urls) if u in urls[:i]), None)
    if dup is not None:
        fail(f"--backend {dup} is given twice")
    if ns.port < 0 or ns.port > 65535:
        fail(f"port={ns.port} must be in [0, 65535]")
    for name in ("metrics_interval", "connect_timeout", "request_timeout"):
        v = getattr(ns, name)
        if v is not None and not (v > 0 and math.isfinite(v)):
            fail(f"{name}={v} must be a finite number > 0")
    if ns.kv_events and len(ns.kv_events) != len(urls):
        fail(f"{len(ns.kv_events)} --kv_events for {len(urls)} --backend: give one per backend")
    for e in ns.kv_events:
        host, _, port = e.rpartition(":")
        if not host.startswith("tcp://") or not port.isdigit() or not 0 < int(port) < 65535:
            fail(f"--kv_events {e!r} must be tcp://HOST:PORT (PORT < 65535: PORT+1 replays)")
    # After the cheap checks: the app module imports FastAPI.
    from paged.router.app import RouterSettings

    try:
        settings = RouterSettings(policy=ns.policy, load_threshold=ns.load_threshold,
                                  metrics_interval_s=ns.metrics_interval,
                                  connect_timeout_s=ns.connect_timeout,
                                  request_timeout_s=ns.request_timeout,
                                  max_tree_chars=ns.max_tree_chars,
                                  prefix_granularity=ns.prefix_granularity,
                                  kv_events=tuple(ns.kv_events))
    except (TypeError, ValueError) as e:
        fail(str(e))
    return urls, settings, ns


def load_tokenizer(model: str):
    """The tokenizer of ``model``: the byte tokenizer of the bundled models, or a checkpoint
    directory's (``config.json``'s ``vocab_size``); `fail` otherwise."""
    from paged.models.registry import KNOWN_MODELS

    if model in KNOWN_MODELS:
        from paged.models.tokenizer import ByteTokenizer

        return ByteTokenizer()
    try:
        from paged.models.hf_config import read_json
        from paged.models.hf_tokenizer import load_tokenizer as load_hf

        return load_hf(model, int(read_json(f"{model}/config.json")["vocab_size"]))
    except (OSError, KeyError, ValueError) as e:
        fail(f"--tokenizer {model!r}: {type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> None:
    urls, settings, ns = parse_args(argv)
    import logging

    import uvicorn

    from paged.router.app import build_app

    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = build_app(urls, settings, load_tokenizer(ns.tokenizer) if ns.tokenizer else None)
    print(f"{PROG}: routing to {len(urls)} backend(s) ({settings.policy}, load_threshold="
          f"{settings.load_threshold}) on http://{ns.host}:{ns.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level, access_log=False)
