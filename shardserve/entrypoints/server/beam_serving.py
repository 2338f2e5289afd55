"""`use_beam_search` on /v1/completions, vLLM's extension: `best_of` beams per prompt (default n),
the best `n` returned as the choices, best first; `length_penalty` ranks them.

The search is entrypoints/beam_search.py's, each step's beams run as concurrent one-token
requests on the async engine (one batch: they are all queued before the engine's next step).
Only what beam search honours may be set: temperature, max_tokens, ignore_eos, echo,
truncate_prompt_tokens, skip_special_tokens, include_stop_str_in_output; a stream, logprobs or a
sampling control (top_p, stop, penalties, structured outputs, ...) is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from shardserve.entrypoints.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchSequence,
    warn_without_prefix_caching,
)
from shardserve.entrypoints.server.disconnect import unless_disconnected
from shardserve.entrypoints.server.protocol import CompletionRequest, ServerError
from shardserve.entrypoints.server.serving import OpenAIServing, _Job
from shardserve.outputs import CompletionOutput, RequestOutput
from shardserve.sampling_params import BeamSearchParams, SamplingParams

# SamplingParams fields beam search does not apply: any of them set is refused.
_NOT_APPLIED = ("top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "stop", "stop_token_ids", "min_tokens",
                "prompt_logprobs", "structured_outputs", "logit_bias", "allowed_token_ids",
                "bad_words")


async def completion_response(serving: OpenAIServing, req: CompletionRequest,
                              raw: HTTPRequest) -> Any:
    """/v1/completions: beam search where asked for, else the ordinary path."""
    if req.use_beam_search:
        return await beam_search_response(serving, req, raw)
    return await serving.respond(serving.completion_job(req), raw)


async def beam_search_response(serving: OpenAIServing, req: CompletionRequest,
                               raw: HTTPRequest) -> JSONResponse:
    """Answer a use_beam_search completion (JSON; 499 if the client leaves first)."""
    if req.stream:
        raise ServerError(400, "use_beam_search is not supported with stream true (the beams "
                          "are only ranked at the end); request it with stream false", "stream")
    if req.logprobs is not None:
        raise ServerError(400, "logprobs is not supported with use_beam_search", "logprobs")
    job = await serving.completion_job(req)
    params = _beam_params(req, job)
    serving.client.admit(len(job.prompts) * params.beam_width)
    body = await unless_disconnected(_respond(serving, job, params), raw)
    return body if isinstance(body, JSONResponse) else JSONResponse(body)


def _beam_params(req: CompletionRequest, job: _Job) -> BeamSearchParams:
    """The request's BeamSearchParams (400 naming a field beam search cannot honour)."""
    sampling = job.params[0]
    default = SamplingParams()
    for name in _NOT_APPLIED:
        if getattr(sampling, name) != getattr(default, name):
            raise ServerError(400, f"{name} is not supported with use_beam_search", name)
    if sampling.top_k_enabled:
        raise ServerError(400, "top_k is not supported with use_beam_search", "top_k")
    width = req.best_of if req.best_of is not None else req.n
    if width < req.n:
        raise ServerError(400, f"best_of (the beam width) must be >= n ({req.n}) with "
                          f"use_beam_search, got {width}", "best_of")
    try:
        return BeamSearchParams(
            beam_width=width, max_tokens=max(p.max_tokens or 1 for p in job.params),
            ignore_eos=sampling.ignore_eos, temperature=sampling.temperature,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=sampling.include_stop_str_in_output)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        if field == "beam_width":
            raise ServerError(400, f"best_of (n if not given) is the beam width: {e}",
                              "best_of") from e
        raise ServerError(400, str(e), field) from e


async def _respond(serving: OpenAIServing, job: _Job, params: BeamSearchParams
                   ) -> dict[str, Any]:
    results = await _search(serving, job, params)
    choices, completion_tokens = [], 0
    for i, ((text, ids), result) in enumerate(zip(job.prompts, results, strict=True)):
        outputs = [await _completion(serving, c, beam, len(ids), params, job)
                   for c, beam in enumerate(result.sequences[:job.n])]
        out = RequestOutput(job.request_id, text, ids, outputs, finished=True)
        choices += [job.format.final_choice(i, i * job.n + c.index, c, out) for c in outputs]
        completion_tokens += sum(len(c.token_ids) for c in outputs)
    prompt_tokens = sum(len(ids) for _, ids in job.prompts)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    return {"id": job.request_id, "object": job.format.object, "created": job.created,
            "model": job.model, "choices": choices, "usage": usage}


async def _search(serving: OpenAIServing, job: _Job, params: BeamSearchParams
                  ) -> list[BeamSearchOutput]:
    """Run the search: each step's beams as concurrent one-token engine requests."""
    client = serving.client
    warn_without_prefix_caching(client.config.cache_config.enable_prefix_caching)
    search = BeamSearch([ids for _, ids in job.prompts], params,
                        client.tokenizer.eos_token_id, serving.max_model_len)
    step = 0
    while not search.done:
        runs = [_last(client.generate(f"{job.request_id}-{step}-{k}", (None, tokens),
                                      search.step_params, lora_request=job.lora_request))
                for k, tokens in enumerate(search.requests())]
        search.advance(await asyncio.gather(*runs))
        step += 1
    return search.results()  # no text: the choices decode only what was generated


async def _completion(serving: OpenAIServing, index: int, beam: BeamSearchSequence,
                      prompt_len: int, params: BeamSearchParams, job: _Job) -> CompletionOutput:
    """A beam as a choice's output: its generated tokens, their text without an ending EOS
    (unless include_stop_str_in_output), as vLLM's server."""
    generated = beam.tokens[prompt_len:]
    shown = generated
    if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
        shown = generated[:-1]
    skip = job.params[0].skip_special_tokens
    tokenizer = serving.client.tokenizer
    text = await asyncio.to_thread(tokenizer.decode, shown, skip_special_tokens=skip)
    return CompletionOutput(index, text, generated, beam.cum_logprob,
                            finish_reason=beam.finish_reason)


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The finished output of one engine request (closing the stream aborts it if unfinished)."""
    last = None
    async with contextlib.aclosing(stream):
        async for out in stream:
            last = out
    if last is None:
        raise RuntimeError("a beam search request ended without an output")
    return last
