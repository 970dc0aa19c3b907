"""An HTTP router in front of several ``paged.server`` instances (data-parallel serving).

Start it with ``python -m paged.router --backend http://127.0.0.1:8000 --backend
http://127.0.0.1:8001 --port 8080`` (see `paged.router.cli`). It speaks the same API as the
servers (``POST /v1/completions``, ``POST /v1/chat/completions``, streaming or not, ``GET
/v1/models``) and forwards each request, unchanged, to one backend chosen by
`paged.fleet.routing.Router`: the same ``round_robin`` / ``least_loaded`` / ``prefix_aware`` code that
routes over in-process engines and in the simulator. ``GET /health`` and ``GET /metrics`` are its
own.

Modules:

- `backends`: per-backend state with the `paged.fleet.routing.Replica` members: an approximate prefix
  tree of the prompts routed to it (characters, LRU-bounded, as SGLang's cache-aware router keeps),
  its in-flight requests, and its waiting / running gauges scraped from its ``/metrics``.
- `app`: the FastAPI app (forwarding and stream relay with ``httpx``, failover on refused
  connections, the scraper, the router's Prometheus metrics).
- `cli`: the command line.
"""

from __future__ import annotations

__all__ = ["RouterSettings", "build_app"]


def __getattr__(name):
    if name in __all__:
        from paged.router import app

        return getattr(app, name)
    raise AttributeError(f"module 'paged.router' has no attribute {name!r}")
