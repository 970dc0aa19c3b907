"""An OpenAI-compatible HTTP server over one `paged.Engine`.

Start it with ``python -m paged.server --model tiny --host 127.0.0.1 --port 8000`` (every
`EngineConfig` field is a flag too: ``--max_num_seqs 64``; see `paged.server.cli`). Endpoints:
``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``"stream": true`` as server-sent events ending in ``data: [DONE]``) and
``GET /metrics`` (Prometheus text).

Modules, one job each:

- `protocol`: request models (pydantic), their checks, and the JSON shapes of responses, chunks
  and errors (OpenAI's).
- `engine_loop`: `EngineLoop`, the one thread that owns the engine; handlers talk to it only
  through a command queue (add / abort) and read their outputs from an asyncio queue.
- `streams`: turning a request's token ids into text deltas (incremental detokenization, stop
  strings) and the per-choice bookkeeping shared by streaming and non-streaming responses.
- `metrics`: the Prometheus registry (one per app) and what the loop updates after each step.
- `app`: the FastAPI routes.
- `cli`: the command line (flags generated from `EngineConfig`'s fields).
"""

from __future__ import annotations

__all__ = ["build_app", "EngineLoop", "ServerSettings"]


def __getattr__(name):
    if name in ("build_app", "ServerSettings"):
        from paged.server import app

        return getattr(app, name)
    if name == "EngineLoop":
        from paged.server.engine_loop import EngineLoop

        return EngineLoop
    raise AttributeError(f"module 'paged.server' has no attribute {name!r}")
