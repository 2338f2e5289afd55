"""The server's engine administration: re-scaling and sleep, as vLLM's server has them.

    POST /scale        {"data_parallel_size": k}      add or remove engine replicas live
    POST /sleep        ?level=1|2 [&replica=i]         free KV cache (and weights at level 2)
    POST /wake_up      [?tags=weights&tags=kv_cache] [&replica=i]
    GET  /is_sleeping  [?replica=i]                    {"is_sleeping": bool, "replicas": {...}}
    POST /start_profile                                torch's profiler on every rank and core
    POST /stop_profile                                 {"traces": [the Chrome trace files]}

They change what every client gets, so they are authenticated: with --api-key they need the
same `Authorization: Bearer <key>` as /v1 (ApiKeyMiddleware covers these paths); without one
the POSTs are refused (403) rather than left open. A replica put to sleep takes no new request
until woken; a sleep while it runs requests is refused (409). The profile endpoints need
--profiler-dir or --profiler-config (404 otherwise); a second start, or a stop without a start,
is a 409.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shardserve.engine.async_engine import AsyncEngineClient
from shardserve.entrypoints.server.protocol import error_body
from shardserve.worker.profiler import ProfilerConfig

ADMIN_PATHS = ("/scale", "/sleep", "/wake_up", "/is_sleeping", "/start_profile", "/stop_profile")


class ScaleRequest(BaseModel):
    data_parallel_size: int


def add_admin_routes(app: FastAPI, client: AsyncEngineClient, api_key: str | None,
                     profiler: ProfilerConfig | None = None) -> None:
    def refused() -> JSONResponse | None:
        if api_key:
            return None  # the middleware has checked the key
        return JSONResponse(error_body(
            "engine administration needs a server started with --api-key (then send "
            "'Authorization: Bearer <key>')", "PermissionDenied", None, 403), status_code=403)

    def targets(replica: int | None) -> list[int] | None:
        return None if replica is None else [replica]

    @app.post("/scale")
    async def scale(body: ScaleRequest) -> Any:
        if (denied := refused()) is not None:
            return denied
        return await _answer(lambda: _scaled(client, body.data_parallel_size))

    @app.post("/sleep")
    async def sleep(level: int = 1, replica: int | None = None) -> Any:
        if (denied := refused()) is not None:
            return denied

        async def run() -> dict[str, Any]:
            await client.call("sleep", level, replicas=targets(replica))
            client.router.asleep.update(targets(replica) or client.router.replicas)
            return {}
        return await _answer(run)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None), replica: int | None = None) -> Any:
        if (denied := refused()) is not None:
            return denied

        async def run() -> dict[str, Any]:
            indices = targets(replica) or client.router.replicas
            await client.call("wake_up", tags, replicas=indices)
            states = await client.call("is_sleeping", replicas=indices)
            for i, asleep in zip(indices, states, strict=True):
                (client.router.asleep.add if asleep else client.router.asleep.discard)(i)
            return {}
        return await _answer(run)

    @app.get("/is_sleeping")
    async def is_sleeping(replica: int | None = None) -> Any:
        async def run() -> dict[str, Any]:
            indices = targets(replica) or client.router.replicas
            states = await client.call("is_sleeping", replicas=indices)
            return {"is_sleeping": all(states),
                    "replicas": {str(i): s for i, s in zip(indices, states, strict=True)}}
        return await _answer(run)

    _add_profile_routes(app, client, refused, profiler)


def _add_profile_routes(app: FastAPI, client: AsyncEngineClient,
                        refused: Callable[[], JSONResponse | None],
                        profiler: ProfilerConfig | None) -> None:
    def no_profiler() -> JSONResponse | None:
        if profiler is not None:
            return refused()
        return JSONResponse(error_body(
            "profiling is off; start the server with --profiler-dir DIR (or --profiler-config "
            "'{\"profiler\": \"torch\", \"torch_profiler_dir\": \"DIR\"}')", "NotFoundError",
            None, 404), status_code=404)

    @app.post("/start_profile")
    async def start_profile() -> Any:
        if (denied := no_profiler()) is not None:
            return denied

        async def run() -> dict[str, Any]:
            await client.call("start_profile", profiler)
            return {}
        return await _answer(run)

    @app.post("/stop_profile")
    async def stop_profile() -> Any:
        if (denied := no_profiler()) is not None:
            return denied

        async def run() -> dict[str, Any]:
            traces = await client.call("stop_profile")
            return {"traces": [path for core in traces for path in core]}
        return await _answer(run)


async def _scaled(client: AsyncEngineClient, size: int) -> dict[str, Any]:
    serving = await client.scale(size)
    return {"data_parallel_size": len(serving), "replicas": serving}


async def _answer(run: Any) -> Any:
    """The handler's result, or the error as OpenAI-style JSON: 400 for a bad value, 409 for
    what the engine refuses in its state (a sleep with requests running)."""
    try:
        return await run()
    except ValueError as e:
        return JSONResponse(error_body(str(e), "BadRequestError", None, 400), status_code=400)
    except RuntimeError as e:
        return JSONResponse(error_body(str(e), "Conflict", None, 409), status_code=409)
