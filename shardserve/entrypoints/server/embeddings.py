"""/v1/embeddings (OpenAI's request and response) on a `--runner pooling` server, and the
refusal of the generation endpoints there.

    request:  model, input (a string, a list of strings, a list of token ids, or a list of
              such lists), encoding_format ("float" | "base64": little-endian float32 bytes,
              as OpenAI), dimensions (only the model's hidden size), user (accepted, unused);
              vLLM's truncate_prompt_tokens and normalize too
    response: {object: "list", data: [{object: "embedding", index, embedding}], model,
               usage: {prompt_tokens, total_tokens}}

Every input is one pooling request, batched by the engine with the others (engine/pooling.py).
On a generate server /v1/embeddings answers 400; on a pooling server the generation
endpoints do (GenerationGuard, before their bodies are parsed).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from shardserve.engine.pooling import pooling_request_params
from shardserve.entrypoints.server.protocol import ServerError, error_body
from shardserve.entrypoints.server.serving import OpenAIServing
from shardserve.lora.request import LoRARequest
from shardserve.pooling_params import PoolingParams
from shardserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class EmbeddingRequest(BaseModel):
    # Other fields are served without them and named in one log line (as the other routes).
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None

    def inputs(self) -> list[str | list[int]]:
        """One entry a pooling request: a string, or token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(t, int) for t in value):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]


def add_embedding_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> JSONResponse:
        return JSONResponse(await embed(serving, body))


def add_generation_guard(app: FastAPI, serving: OpenAIServing) -> None:
    """On a pooling server, the generation endpoints answer 400 (installed before the API-key
    check, so that check still comes first)."""
    if serving.client.config.model_config.is_pooling:
        app.add_middleware(GenerationGuard)


class GenerationGuard:
    """A plain ASGI middleware: POSTs to GENERATION_PATHS get a 400 naming the runner."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        message = await receive()  # read the body, so the connection stays usable
        while message.get("more_body"):
            message = await receive()
        text = (f"{scope['path']} is not available: this server runs --runner pooling and "
                f"computes embeddings only (POST /v1/embeddings); start it without --runner "
                f"pooling to generate")
        response = JSONResponse(error_body(text, "BadRequestError", None, 400), status_code=400)
        await response(scope, receive, send)


async def embed(serving: OpenAIServing, req: EmbeddingRequest) -> dict[str, Any]:
    client = serving.client
    if not client.config.model_config.is_pooling:
        raise ServerError(400, "/v1/embeddings needs a server started with --runner pooling; "
                          "this one runs --runner generate (completions and chat)", "model")
    lora = serving.lora_for(req.model)
    if req.model_extra:
        logger.info("ignored /v1/embeddings fields: %s", ", ".join(sorted(req.model_extra)))
    texts = req.inputs()
    if not texts:
        raise ServerError(400, "input is empty; give a string, a list of strings or token "
                          "ids", "input")
    serving.limits.check_prompt_count(len(texts), 1)
    client.check_alive()
    params = _params(serving, req)
    try:
        prompts = await serving.prompts.completion_prompts(texts, params.truncate_prompt_tokens)
    except ServerError as e:
        raise ServerError(400, e.message.replace("prompt", "input", 1), "input") from e
    client.admit(len(prompts))
    request_id = f"embd-{uuid.uuid4().hex}"
    vectors = await asyncio.gather(*(
        _one(serving, f"{request_id}-{i}", prompt, params, lora)
        for i, prompt in enumerate(prompts)))
    num_tokens = sum(len(ids) for _, ids in prompts)
    return {"id": request_id, "object": "list", "created": int(time.time()),
            "model": req.model or serving.served_name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encoded(v, req.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _params(serving: OpenAIServing, req: EmbeddingRequest) -> SamplingParams:
    """The pooling request's params; a 400 naming the field for a bad one."""
    try:
        pooling = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        return pooling_request_params(serving.client.config, pooling,
                                      req.truncate_prompt_tokens)
    except ValueError as e:
        message = str(e)
        raise ServerError(400, message, message.split("=", 1)[0].split(" ", 1)[0]) from e


async def _one(serving: OpenAIServing, request_id: str, prompt: tuple[str | None, list[int]],
               params: SamplingParams, lora: LoRARequest | None) -> np.ndarray:
    """One input's vector (leaving early aborts its engine request: generate's finally)."""
    final = None
    async for out in serving.client.generate(request_id, prompt, params, lora_request=lora):
        final = out
    if final is None or final.pooled is None:
        raise ServerError(500, f"request {request_id} ended without an embedding")
    return final.pooled


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()
