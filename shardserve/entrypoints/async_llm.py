"""AsyncLLM (vLLM's `AsyncLLM` / `AsyncLLMEngine`): the engine for asyncio programs.

The engine core runs in its own process, as under `shardserve serve` (AsyncLLM is the server's
engine client, engine/async_engine.py, without the HTTP layer and its metrics); `generate()` is
an async iterator of cumulative RequestOutputs, and leaving it early aborts the request.

    engine = AsyncLLM.from_engine_args(EngineArgs(model=None))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=16), "req-1"):
        print(output.outputs[0].text)
    engine.shutdown()
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from shardserve.config import EngineConfig
from shardserve.engine.arg_utils import EngineArgs
from shardserve.engine.async_engine import AsyncEngineClient
from shardserve.engine.llm_engine import PromptType
from shardserve.lora.request import LoRARequest
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import SamplingParams
from shardserve.worker import profiler
from shardserve.worker.profiler import ProfilerConfig


class AsyncLLM:
    def __init__(self, config: EngineConfig, stream_interval: int = 1,
                 profiler_config: ProfilerConfig | dict | str | None = None) -> None:
        self.config = config
        self._profiler_config = ProfilerConfig.parse(profiler_config)
        self._client = AsyncEngineClient(config, stream_interval=stream_interval)
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_engine_args(cls, engine_args: Any, **_: Any) -> AsyncLLM:
        return cls(engine_args.create_engine_config())

    @property
    def tokenizer(self) -> Any:
        return self._client.tokenizer

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | dict,
                       request_id: str, *, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one request as it runs (the last has finished=True); `priority`
        needs scheduling_policy="priority" (lower value first); `lora_request` enable_lora
        (its adapter is loaded first, once)."""
        await self._start()
        params = sampling_params if isinstance(sampling_params, SamplingParams) \
            else SamplingParams(**sampling_params)
        self._client.inputs.check_params(params)
        self._client.inputs.check_priority(priority)
        processed = self._client.inputs.process_prompt(prompt, params.truncate_prompt_tokens)
        async for output in self._client.generate(request_id, processed, params, priority,
                                                  lora_request):
            yield output

    # LoRA adapters (enable_lora=True), loaded on every rank; async, as vLLM's AsyncLLM.
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        await self._start()
        return await self._client.loras.add(lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        await self._start()
        return await self._client.loras.remove(lora_int_id)

    async def pin_lora(self, lora_int_id: int) -> bool:
        await self._start()
        return await self._client.loras.pin(lora_int_id)

    async def list_loras(self) -> set[int]:
        await self._start()
        return await self._client.loras.list()

    async def abort(self, request_id: str) -> None:
        await self._client.abort(request_id)

    async def start_profile(self) -> None:
        """torch's profiler on every rank and engine core (needs profiler_config)."""
        config = profiler.required(self._profiler_config, "AsyncLLM")
        await self._start()
        await self._client.call("start_profile", config)

    async def stop_profile(self) -> list[str]:
        """Stop the profile; the Chrome trace files the ranks and engine cores wrote."""
        await self._start()
        return [path for core in await self._client.call("stop_profile") for path in core]

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            await self._client.start()
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an AsyncLLM runs in the event loop it was first used in")

    async def shutdown_async(self) -> None:
        await self._client.shutdown()

    def shutdown(self) -> None:
        """Stop the engine process (from outside the event loop, e.g. after asyncio.run)."""
        if self._loop is not None and not self._loop.is_closed() and self._loop.is_running():
            raise RuntimeError("inside the event loop, await engine.shutdown_async()")
        self._client.shutdown_sync()
        self._client.close_sockets()


AsyncLLMEngine = AsyncLLM  # vLLM's older name for the same engine
AsyncEngineArgs = EngineArgs
