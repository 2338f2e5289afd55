"""Pooling requests at the front end: which runner may take which request, and the
SamplingParams that carry a pooling request through the engine.

A pooling request is a prefill that samples nothing: max_tokens=1 keeps the scheduler from
planning a decode for it (the token its prefill would sample is never sampled; the workers
pool instead, see worker/pooler.py), detokenize=False keeps the output processor from
decoding, and `SamplingParams.pooling` tells the workers how to pool. Its KV blocks are freed
when the vector comes back, as any finished request's.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardserve.config import EngineConfig
from shardserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from shardserve.pooling_params import PoolingParams
from shardserve.sampling_params import SamplingParams

GENERATE_ON_POOLING = (
    "this engine runs runner='pooling' (it computes embeddings and samples no tokens): use "
    "LLM.embed or /v1/embeddings, or start the engine with runner='generate' (the default) to "
    "generate")
POOLING_ON_GENERATE = (
    "embeddings need an engine started with runner='pooling' (LLM(model, runner='pooling'), "
    "shardserve serve MODEL --runner pooling); this one runs runner='generate'")


def check_runner(config: EngineConfig, params: SamplingParams) -> None:
    """ValueError for a generation request on a pooling engine, or the other way round."""
    pooling_engine = config.model_config.is_pooling
    if params.pooling is not None and not pooling_engine:
        raise ValueError(POOLING_ON_GENERATE)
    if params.pooling is None and pooling_engine:
        raise ValueError(GENERATE_ON_POOLING)


def pooling_request_params(config: EngineConfig, params: PoolingParams | None = None,
                           truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """The SamplingParams of one pooling request (ValueError naming a bad option)."""
    if not config.model_config.is_pooling:
        raise ValueError(POOLING_ON_GENERATE)
    params = params if params is not None else PoolingParams()
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
    pooler = config.model_config.pooler_config
    assert pooler is not None  # set on every pooling ModelConfig
    spec = params.resolve(pooler, config.model_config.arch.hidden_size)
    truncate = truncate_prompt_tokens if truncate_prompt_tokens is not None \
        else params.truncate_prompt_tokens
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                          truncate_prompt_tokens=truncate, pooling=spec)


def pooling_params_list(config: EngineConfig, params: PoolingParams | Sequence[PoolingParams]
                        | None, n: int, truncate_prompt_tokens: int | None = None
                        ) -> list[SamplingParams]:
    """One request's SamplingParams per prompt, from one PoolingParams or one per prompt."""
    if params is None or isinstance(params, PoolingParams):
        return [pooling_request_params(config, params, truncate_prompt_tokens)] * n
    given = list(params)
    if len(given) != n:
        raise ValueError(f"got {len(given)} pooling_params for {n} prompts; give 1 or {n}")
    return [pooling_request_params(config, p, truncate_prompt_tokens) for p in given]


def embedding_output(out: RequestOutput) -> EmbeddingRequestOutput:
    """vLLM's EmbeddingRequestOutput of a finished pooling request."""
    if out.pooled is None:  # aborted before its prompt was computed
        reason = out.outputs[0].finish_reason if out.outputs else None
        raise RuntimeError(f"request {out.request_id} ended without an embedding "
                           f"(finish_reason {reason})")
    return EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.pooled.tolist()),
                                  out.prompt_token_ids, out.finished)
