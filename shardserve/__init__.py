"""shardserve: an LLM inference engine around a vLLM-style distributed executor layer."""

from typing import Any

from shardserve.engine.arg_utils import EngineArgs
from shardserve.engine.llm_engine import LLMEngine
from shardserve.entrypoints.llm import LLM
from shardserve.errors import EngineDeadError
from shardserve.inputs import TextPrompt, TokensPrompt
from shardserve.lora.request import LoRARequest
from shardserve.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from shardserve.pooling_params import PoolerConfig, PoolingParams
from shardserve.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "AsyncEngineArgs", "AsyncLLM", "AsyncLLMEngine", "BeamSearchParams",
           "CompletionOutput", "EngineArgs", "EngineDeadError", "LLMEngine", "RequestOutput",
           "SamplingParams", "StructuredOutputsParams", "TextPrompt", "TokensPrompt"]

__all__ += ["EmbeddingRequestOutput", "LoRARequest", "PoolerConfig", "PoolingParams"]

_ASYNC = {"AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs"}


def __getattr__(name: str) -> Any:
    # Imported on use: the async engine pulls in pyzmq's asyncio layer.
    if name in _ASYNC:
        from shardserve.entrypoints import async_llm

        return getattr(async_llm, name)
    raise AttributeError(f"module 'shardserve' has no attribute {name!r}")
