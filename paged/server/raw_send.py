"""Streaming past Starlette's middleware: the outermost ASGI layer keeps the server's own
``send`` in the scope (`keep_raw_send`, which may also answer a request itself through a gate),
and `EventStream` sends its body chunks, the hot path of streaming, straight to it.
"""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

RAW_SEND = "paged.raw_send"


async def answer(send, status: int, body: dict, headers: dict) -> None:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw})


def keep_raw_send(app: FastAPI, gate=None) -> None:
    """Makes the outermost layer of ``app`` keep the server's own ``send`` in the scope, so
    that `EventStream` can send body chunks past the middleware stack (each layer wraps
    ``send`` in a coroutine that only watches for the response start); ``gate`` (`paged.server.app`'s) may
    answer a request there instead."""
    build = app.build_middleware_stack

    def build_with_raw_send():
        inner = build()

        async def outer(scope, receive, send):
            if scope["type"] == "http":
                scope[RAW_SEND] = send
                reply = gate(scope) if gate is not None else None
                if reply is not None:
                    await answer(send, *reply)
                    return
            await inner(scope, receive, send)

        return outer

    app.build_middleware_stack = build_with_raw_send


class EventStream(StreamingResponse):
    """A StreamingResponse (disconnects cancel the body iterator, as Starlette's do) whose
    response start and end go through the middleware stack, and whose body chunks, the hot
    path of streaming, go straight to the server's ``send``."""

    async def __call__(self, scope, receive, send):
        self._raw_send = scope.get(RAW_SEND) or send
        await super().__call__(scope, receive, send)

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        raw = self._raw_send
        async for chunk in self.body_iterator:
            await raw({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
