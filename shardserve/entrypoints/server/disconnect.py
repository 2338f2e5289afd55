"""A non-streamed response's work raced against the client leaving: the work's result, or a
499 once the client is gone (the work is cancelled, which aborts its engine requests)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from shardserve.entrypoints.server.protocol import error_body


async def unless_disconnected(work_coro: Awaitable[Any], raw: HTTPRequest) -> Any:
    """`work_coro`'s result, or a 499 response if the client leaves first (the work is then
    cancelled, which aborts its engine requests)."""
    work = asyncio.ensure_future(work_coro)
    disconnect = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait([work, disconnect], return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not work.done():  # the client left (or we were cancelled): abort the requests
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        return JSONResponse(error_body("client disconnected", "ClientDisconnect", None, 499),
                            status_code=499)
    return work.result()


async def _wait_disconnect(raw: HTTPRequest) -> None:
    """Returns when the client disconnects (the body has been read: receive() waits for that)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
