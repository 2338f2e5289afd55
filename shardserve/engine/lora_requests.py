"""The front end's side of LoRA, one for every front end (LLMEngine, AsyncEngineClient): the
check of a request's `lora_request`, which adapters the engine cores have been given, and the
adapter calls (add_lora, remove_lora, pin_lora, list_loras) to every engine core.

A request's adapter is loaded on every rank (`add_lora`, a utility call to each engine core)
before the request is queued, once per adapter id: a bad adapter (a LoRAError from the ranks,
a ValueError here) fails that request's call and nothing else. The workers may still evict an
adapter (max_cpu_loras, least recently used first); a step that needs it again loads it from
its lora_path, so nothing here assumes an adapter stays loaded. What this keeps is which
adapter each id stands for: one id naming two adapters would let their requests share prefix
cache blocks and worker slots, so it is refused while the first is loaded.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from shardserve.config import EngineConfig
from shardserve.lora.request import LoRARequest


def check_lora_request(config: EngineConfig, lora_request: Any) -> LoRARequest | None:
    """The request's adapter, or None for the base model; ValueError naming what to change."""
    if lora_request is None:
        return None
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest (from shardserve.lora.request "
                         f"import LoRARequest) or None, got {type(lora_request).__name__}")
    if config.lora_config is None:
        raise ValueError(f"lora_request={lora_request.lora_name!r} needs LoRA, which this engine "
                         f"runs without: start it with enable_lora=True (--enable-lora)")
    return lora_request


class LoRARegistry:
    """The adapters this front end has had loaded, by id."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._loaded: dict[int, LoRARequest] = {}

    def to_load(self, lora_requests: Iterable[Any]) -> list[LoRARequest]:
        """The distinct adapters among `lora_requests` not loaded yet, each checked (also
        against the others: one id for two adapters is refused)."""
        new: dict[int, LoRARequest] = {}
        for req in lora_requests:
            req = check_lora_request(self.config, req)
            if req is None:
                continue
            known = self._loaded.get(req.lora_int_id) or new.get(req.lora_int_id)
            if known is not None and not _same_adapter(known, req):
                raise ValueError(
                    f"lora_int_id={req.lora_int_id} is adapter {known.lora_name!r} "
                    f"({known.lora_path}); give {req.lora_name!r} ({req.lora_path}) an id of its "
                    f"own, or remove_lora({req.lora_int_id}) first")
            if known is None:
                new[req.lora_int_id] = req
        return list(new.values())

    def check_new(self, lora_request: Any) -> LoRARequest:
        """A LoRARequest for add_lora, checked (an id naming another adapter is refused)."""
        checked = check_lora_request(self.config, lora_request)
        if checked is None:
            raise ValueError("add_lora needs a LoRARequest, got None")
        self.to_load([checked])
        return checked

    def loaded(self, lora_request: LoRARequest) -> None:
        self._loaded[lora_request.lora_int_id] = lora_request

    def removed(self, lora_int_id: int) -> None:
        self._loaded.pop(lora_int_id, None)

    def check_id(self, lora_int_id: Any) -> int:
        """An adapter id for remove_lora / pin_lora; ValueError naming what is wrong."""
        if self.config.lora_config is None:
            raise ValueError("LoRA is not enabled on this engine; start it with "
                             "enable_lora=True (--enable-lora)")
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int) or lora_int_id < 1:
            raise ValueError(f"lora_int_id={lora_int_id!r} must be an int >= 1")
        return lora_int_id


class FrontEndLoRAs:
    """A synchronous front end's adapter calls (LLMEngine): `call(method, *args)` runs an
    engine-core method on every replica and returns their answers (EngineCoreClient.call)."""

    def __init__(self, config: EngineConfig, call: Callable[..., list[Any]]) -> None:
        self.registry = LoRARegistry(config)
        self._call = call

    def load(self, lora_requests: Iterable[Any]) -> None:
        """Load every adapter of `lora_requests` not loaded yet, on every rank of every
        engine core; the first that fails raises (its LoRAError: a ValueError)."""
        for lora_request in self.registry.to_load(lora_requests):
            self.add(lora_request)

    def add(self, lora_request: LoRARequest) -> bool:
        """Load the adapter on every rank (vLLM's add_lora); False if it was loaded already."""
        lora_request = self.registry.check_new(lora_request)
        added = self._call("add_lora", lora_request)
        self.registry.loaded(lora_request)
        return any(added)

    def remove(self, lora_int_id: int) -> bool:
        """Unload the adapter from every rank; False if no rank held it."""
        self.registry.removed(self.registry.check_id(lora_int_id))
        return any(self._call("remove_lora", lora_int_id))

    def pin(self, lora_int_id: int) -> bool:
        """Keep the adapter loaded whatever max_cpu_loras evicts."""
        return all(self._call("pin_lora", self.registry.check_id(lora_int_id)))

    def list(self) -> set[int]:
        """The adapter ids loaded on the ranks (of any engine core)."""
        if self.registry.config.lora_config is None:
            return set()
        return {i for ids in self._call("list_loras") for i in ids}


class AsyncFrontEndLoRAs:
    """FrontEndLoRAs for the asyncio front end (AsyncEngineClient): `call` is a coroutine."""

    def __init__(self, config: EngineConfig, call: Callable[..., Awaitable[list[Any]]]) -> None:
        self.registry = LoRARegistry(config)
        self._call = call

    async def load(self, lora_requests: Iterable[Any]) -> None:
        for lora_request in self.registry.to_load(lora_requests):
            await self.add(lora_request)

    async def add(self, lora_request: LoRARequest) -> bool:
        lora_request = self.registry.check_new(lora_request)
        added = await self._call("add_lora", lora_request)
        self.registry.loaded(lora_request)
        return any(added)

    async def remove(self, lora_int_id: int) -> bool:
        self.registry.removed(self.registry.check_id(lora_int_id))
        return any(await self._call("remove_lora", lora_int_id))

    async def pin(self, lora_int_id: int) -> bool:
        return all(await self._call("pin_lora", self.registry.check_id(lora_int_id)))

    async def list(self) -> set[int]:
        if self.registry.config.lora_config is None:
            return set()
        return {i for ids in await self._call("list_loras") for i in ids}


def _same_adapter(a: LoRARequest, b: LoRARequest) -> bool:
    return (a.lora_name, a.lora_path) == (b.lora_name, b.lora_path)
