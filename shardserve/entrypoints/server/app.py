"""The FastAPI app: routes, API-key check, and every error in OpenAI's format.

Error mapping: a pydantic validation error or bad JSON → 400 naming the field; ServerError →
its status; EngineDeadError → 503. /health, /metrics and /version need no API key.
"""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardserve.engine.async_engine import AsyncEngineClient, QueueFullError
from shardserve.engine.dp_router import NoReplicaError
from shardserve.entrypoints.server import responses_api
from shardserve.entrypoints.server.admin import ADMIN_PATHS, add_admin_routes
from shardserve.entrypoints.server.beam_serving import completion_response
from shardserve.entrypoints.server.body_limit import BodySizeLimit
from shardserve.entrypoints.server.embeddings import add_embedding_routes, add_generation_guard
from shardserve.entrypoints.server.limits import ServerLimits
from shardserve.entrypoints.server.lora_serving import LoRAModule, ServedAdapters, add_lora_routes
from shardserve.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ServerError,
    TokenizeRequest,
    error_body,
)
from shardserve.entrypoints.server.responses_protocol import ResponsesRequest
from shardserve.entrypoints.server.serving import OpenAIServing
from shardserve.errors import EngineDeadError
from shardserve.worker.profiler import ProfilerConfig


def build_app(client: AsyncEngineClient, served_name: str, aliases: set[str],
              api_key: str | None = None, docs: bool = True,
              limits: ServerLimits | None = None, chat_template: str | None = None,
              tool_parser: str | None = None, lora_modules: list[LoRAModule] | None = None,
              allow_runtime_lora: bool = False, profiler: ProfilerConfig | None = None
              ) -> FastAPI:
    limits = limits or ServerLimits()
    adapters = ServedAdapters(client, served_name, lora_modules, allow_runtime_lora, aliases)
    serving = OpenAIServing(client, served_name, aliases, limits, chat_template, tool_parser,
                            adapters)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        try:
            await adapters.load_startup()  # --lora-modules: a bad adapter stops the start
            yield
        finally:
            # Runs when uvicorn stops (SIGTERM / Ctrl-C): stop the engine and its workers.
            await client.shutdown()

    urls = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="shardserve", lifespan=lifespan, **urls)
    app.state.serving = serving
    _add_error_handlers(app)
    add_generation_guard(app, serving)  # --runner pooling: generation endpoints answer 400
    if api_key:
        _add_api_key_check(app, api_key)
    _add_routes(app, serving)
    add_embedding_routes(app, serving)
    add_admin_routes(app, client, api_key, profiler)
    add_lora_routes(app, adapters, api_key)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_body_bytes)
    return app


def _add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    client = serving.client

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: HTTPRequest):
        return await completion_response(serving, body, raw)  # use_beam_search too

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: HTTPRequest):
        return await serving.respond(serving.chat_job(body), raw)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: HTTPRequest):
        return await responses_api.respond(serving, body, raw)

    def cards() -> list[dict[str, Any]]:
        """The base model, then each LoRA adapter (its parent: the base model)."""
        created = int(time.time())
        base = {"id": serving.served_name, "object": "model", "created": created,
                "owned_by": "shardserve", "root": str(client.config.model_config.path),
                "max_model_len": serving.max_model_len}
        return [base, *serving.adapters.cards(created)]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        lora = serving.lora_for(model_id)
        return cards()[0] if lora is None else \
            next(c for c in cards() if c["id"] == lora.lora_name)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await serving.detokenize(body)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/health")
    async def health() -> Response:
        return _health_response(client)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(client.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        try:
            return {"version": version("shardserve")}
        except PackageNotFoundError:
            return {"version": "unknown"}


def _health_response(client: AsyncEngineClient) -> Response:
    """200 {"status": "ok"}; while a replica restarts, {"status": "degraded" (200: the others
    serve) or "restarting" (503: none serves yet, so a load balancer sends elsewhere; requests
    that come wait for it, up to --engine-restart-timeout), "replicas_down": [...]} with the
    header X-Shardserve-Health: <status>; 503 with the error once the engine is dead."""
    status = client.health
    if client.is_dead or status == "dead":
        return JSONResponse(error_body(client.dead_error or "dead", "ServiceUnavailableError",
                                       None, 503), status_code=503)
    if status == "ok":
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": status, "replicas_down": list(client.replicas_down)},
                        headers={"X-Shardserve-Health": status},
                        status_code=503 if status == "restarting" else 200)


def _add_api_key_check(app: FastAPI, api_key: str) -> None:
    # A plain ASGI middleware: Starlette's BaseHTTPMiddleware would sit between a streaming
    # response and the client's disconnect message.
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)


class ApiKeyMiddleware:
    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith("/v1") or path in ADMIN_PATHS:
            given = dict(scope.get("headers", [])).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(
                    error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                               "AuthenticationError", None, 401), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def server_error(request: HTTPRequest, exc: ServerError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: HTTPRequest, exc: QueueFullError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "ServiceUnavailableError", None, 503),
                            status_code=503, headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(NoReplicaError)
    async def no_replica(request: HTTPRequest, exc: NoReplicaError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "ServiceUnavailableError", None, 503),
                            status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: HTTPRequest, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "ServiceUnavailableError", None, 503),
                            status_code=503)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(exc.errors())
        return JSONResponse(error_body(message, "BadRequestError", param, 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), _http_type(exc.status_code), None,
                                       exc.status_code), status_code=exc.status_code)


def _http_type(status: int) -> str:
    return {404: "NotFoundError", 405: "MethodNotAllowed"}.get(status, "BadRequestError")


# Union-typed fields: pydantic reports one error per member type; one line reads better.
_UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of such lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message for pydantic's errors, and the first offending field."""
    parts, param = [], None
    for err in errors[:8]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            parts.append(f"the request body is not valid JSON ({ctx})")
            continue
        if not loc and err.get("type") == "missing":
            parts.append("the request body is empty; send a JSON object")
            continue
        tags = [x for x in loc if _is_type_tag(x)]
        field_name = ".".join(x for x in loc if not _is_type_tag(x)) or "body"
        param = param or field_name
        got = repr(err.get("input"))[:60]
        hint = _UNION_HINTS.get(loc[tags and loc.index(tags[0]) - 1 or 0] if loc else "")
        if tags and hint:
            head = ".".join(loc[: loc.index(tags[0])])
            if not any(p.startswith(f"{head} must be") for p in parts):  # first has the input
                parts.append(f"{head} must be {hint} (got {got})")
        else:
            parts.append(f"{field_name}: {err.get('msg', 'invalid')} (got {got})")
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "function-after", "none"} \
        or part.startswith(("list[", "dict[", "literal["))
