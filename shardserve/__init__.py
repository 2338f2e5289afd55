"""shardserve: an LLM inference engine around a vLLM-style distributed executor layer."""

from shardserve.entrypoints.llm import LLM
from shardserve.errors import EngineDeadError
from shardserve.outputs import CompletionOutput, RequestOutput
from shardserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineDeadError", "RequestOutput", "SamplingParams"]
