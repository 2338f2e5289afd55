"""LoRA adapters served by name, as vLLM's server does.

    --enable-lora --lora-modules sql=/adapters/sql '{"name": "chat", "path": "/a/chat",
                                                     "base_model_name": "base"}'
    GET  /v1/models                  the base model, then each adapter (parent: its base model)
    POST /v1/load_lora_adapter       {"lora_name": ..., "lora_path": ...}   (admin)
    POST /v1/unload_lora_adapter     {"lora_name": ...}                     (admin)

A request whose `model` is an adapter's name runs with that adapter; a name that is neither the
base model nor a loaded adapter is a 404 naming what is loaded, never the base model in its
place. An adapter is loaded on every rank when it is added (at start-up for --lora-modules), so
a bad one is refused there (400 with the engine's message naming the field), not at its first
request. The run-time endpoints exist only with --allow-runtime-lora-updating (404 otherwise);
like /scale they change what every client gets, so they need the admin key (--api-key): without
one they answer 403.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from shardserve.engine.async_engine import AsyncEngineClient
from shardserve.entrypoints.server.protocol import ServerError, error_body
from shardserve.lora.request import LoRARequest

LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModule]:
    """--lora-modules values: `name=path`, or a JSON object {"name", "path",
    "base_model_name"?}; ValueError naming a malformed one and the forms it may take."""
    modules = [_parse_module(v) for v in values or []]
    names = [m.name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {twice} more than once; give each adapter a "
                         f"name of its own")
    return modules


def _parse_module(value: str) -> LoRAModule:
    forms = ("name=path or '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    if value.lstrip().startswith("{"):
        try:
            fields = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {value!r} is not valid JSON ({e}); give {forms}") \
                from e
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(fields.get("name"), str) or \
                not isinstance(fields.get("path"), str):
            raise ValueError(f"--lora-modules {value!r}: needs string \"name\" and \"path\""
                             f"{f', unknown keys {unknown}' if unknown else ''}; give {forms}")
        return LoRAModule(fields["name"], fields["path"], fields.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {value!r}: give {forms}")
    return LoRAModule(name, path)


class ServedAdapters:
    """The adapters this server serves, by name; ids are handed out here, one per load."""

    def __init__(self, client: AsyncEngineClient, base_name: str,
                 modules: list[LoRAModule] | None = None, runtime_updates: bool = False,
                 base_aliases: set[str] | None = None) -> None:
        self.client = client
        self.base_name = base_name
        self.base_aliases = {base_name, *(base_aliases or ())}  # names that mean the base
        self.modules = modules or []
        self.runtime_updates = runtime_updates
        self._loaded: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one load or unload at a time: names stay unique

    @property
    def enabled(self) -> bool:
        return self.client.config.lora_config is not None

    def get(self, name: str | None) -> LoRARequest | None:
        return self._loaded.get(name) if name is not None else None

    def names(self) -> list[str]:
        return list(self._loaded)

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "shardserve",
                 "root": req.lora_path, "parent": req.base_model_name or self.base_name}
                for name, req in self._loaded.items()]

    async def load_startup(self) -> None:
        """Load every --lora-modules adapter (a bad one stops the start, naming it)."""
        for m in self.modules:
            try:
                await self.load(m.name, m.path, m.base_model_name)
            except ServerError as e:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {e.message}") from e

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if not self.enabled:
            raise ServerError(400, "LoRA adapters need a server started with --enable-lora",
                              "lora_name")
        async with self._lock:
            if name in self._loaded or name in self.base_aliases:
                owner = "an adapter" if name in self._loaded else "the base model"
                raise ServerError(400, f"the name {name!r} is taken (by {owner}); unload it "
                                  f"first or choose another lora_name", "lora_name")
            req = LoRARequest(name, next(self._ids), path, base_model_name)
            try:
                await self.client.loras.add(req)
            except ValueError as e:  # the adapter was refused: LoRAError, a bad path
                raise ServerError(400, _engine_message(e), "lora_path") from e
            self._loaded[name] = req
            return req

    async def unload(self, name: str) -> None:
        async with self._lock:
            req = self._loaded.get(name)
            if req is None:
                raise ServerError(404, f"no LoRA adapter named {name!r} is loaded; loaded: "
                                  f"{self.names() or 'none'}", "lora_name")
            await self.client.loras.remove(req.lora_int_id)
            del self._loaded[name]


def _engine_message(error: Exception) -> str:
    """The refusal without the utility call's prefix ("engine core 0: add_lora: LoRAError: ")."""
    text = str(error)
    for marker in ("LoRAError: ", "ValueError: "):
        if marker in text:
            return text.split(marker, 1)[1]
    return text


class LoadLoRARequest(BaseModel):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRARequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's request has it; the name decides here


def add_lora_routes(app: FastAPI, adapters: ServedAdapters, api_key: str | None) -> None:
    def refused() -> JSONResponse | None:
        if not adapters.runtime_updates:
            return JSONResponse(error_body(
                "loading LoRA adapters at run time is off; start the server with "
                "--allow-runtime-lora-updating (and --enable-lora, --api-key)",
                "NotFoundError", None, 404), status_code=404)
        if api_key:
            return None  # ApiKeyMiddleware has checked the key (the paths are under /v1)
        return JSONResponse(error_body(
            "loading LoRA adapters needs a server started with --api-key (then send "
            "'Authorization: Bearer <key>')", "PermissionDenied", None, 403), status_code=403)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> Any:
        if (denied := refused()) is not None:
            return denied
        await adapters.load(body.lora_name, body.lora_path, body.base_model_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> Any:
        if (denied := refused()) is not None:
            return denied
        await adapters.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 f"successfully.")
