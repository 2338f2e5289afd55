"""HTTP 413 for a request body over the server's limit (--max-request-body-bytes), before the
body is read in full."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from shardserve.entrypoints.server.protocol import error_body


class BodyTooLarge(HTTPException):
    """Raised from receive(). An HTTPException because FastAPI passes those on when met while
    reading the body (any other error there becomes its generic 400); BodySizeLimit then
    answers in the app's place."""


class BodySizeLimit:
    """ASGI middleware: HTTP 413 for a body over `max_bytes`, before it is read in full: at once
    when Content-Length says so, else as soon as the chunks received add up to more.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware would sit between a streaming
    response and the client's disconnect message."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(f"is {declared} bytes", scope, receive, send)
            return
        received, too_large, started = 0, False, False

        async def counting_receive() -> dict:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise BodyTooLarge(413, self._message(f"is over {received} bytes so far"))
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if too_large and not started:  # the app's answer to BodyTooLarge: ours replaces it
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            if started:  # read by a handler after it began its response: nothing left to say
                raise
        if too_large and not started:
            await self._refuse(f"is over {received} bytes so far", scope, receive, send)

    def _message(self, size: str) -> str:
        return (f"the request body {size}, over the server's limit of {self.max_bytes} bytes "
                f"(--max-request-body-bytes); send a smaller request")

    async def _refuse(self, size: str, scope: dict, receive: Any, send: Any) -> None:
        body = error_body(self._message(size), "RequestTooLargeError", None, 413)
        await JSONResponse(body, status_code=413)(scope, receive, send)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed one
    return None
