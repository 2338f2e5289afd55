"""vLLM's engine API: EngineArgs (every option, its CLI), LLMEngine.from_engine_args with
add_request / step / abort_request, and AsyncLLM whose generate() is an async iterator, equal to
the offline engine, with an abort mid-stream; the engine process is gone after shutdown()."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import psutil
import pytest

import shardserve
from shardserve import EngineArgs, LLMEngine, SamplingParams
from shardserve.config.engine import OWNERS, option_names

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_engine_args_cover_every_option_and_build_the_cli(tiny_llama_dir):
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    for cls in OWNERS.values():  # every option, but the index set per replica
        assert option_names(cls) - {"data_parallel_rank"} <= names, cls.__name__
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--max-model-len", "64",
                              "--dtype", "float32", "--no-async-scheduling"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.max_model_len, engine_args.async_scheduling) == (64, False)
    config = engine_args.create_engine_config()
    assert config.model_config.max_model_len == 64
    assert not config.scheduler_config.async_scheduling


def test_llm_engine_step_loop(tiny_llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                                                   max_model_len=64))
    try:
        engine.add_request("a", "hello there", GREEDY)
        engine.add_request("b", "stop me", SamplingParams(max_tokens=50, ignore_eos=True))
        engine.abort_request("b")
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert len(finished["a"].outputs[0].token_ids) == 8
        assert finished.get("b") is None or finished["b"].outputs[0].finish_reason == "abort"
    finally:
        engine.shutdown()


def test_async_llm_generate_equals_offline(tiny_llama_dir):
    offline = shardserve.LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64)
    want = [o.outputs[0].token_ids for o in
            offline.generate(["hello there", "one two"], GREEDY, use_tqdm=False)]
    offline.shutdown()
    engine = shardserve.AsyncLLM.from_engine_args(
        shardserve.AsyncEngineArgs(model=str(tiny_llama_dir), dtype="float32", max_model_len=64))
    pid = engine._client.replicas.group.procs[0].proc.pid

    async def one(prompt: str, rid: str) -> list[int]:
        last = None
        async for out in engine.generate(prompt, GREEDY, rid):
            last = out
        assert last is not None and last.finished
        return last.outputs[0].token_ids

    async def aborted() -> str | None:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        async for out in engine.generate("abort me", params, "c"):
            if len(out.outputs[0].token_ids) >= 2:
                break  # leaving the iterator aborts the request
        return None

    async def main() -> list[list[int]]:
        results = await asyncio.gather(one("hello there", "a"), one("one two", "b"), aborted())
        return list(results[:2])

    try:
        assert asyncio.run(main()) == want
    finally:
        engine.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert shardserve.AsyncLLMEngine is shardserve.AsyncLLM


def test_async_llm_rejects_bad_input(tiny_llama_dir):
    engine = shardserve.AsyncLLM(EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                                            max_model_len=64).create_engine_config())

    async def main() -> None:
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in engine.generate([], GREEDY, "x"):
                pass
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            async for _ in engine.generate("x", {"structured_outputs": {"regex": "a("}}, "y"):
                pass
        out = [o async for o in engine.generate("fine", GREEDY, "z")]  # still serving
        assert out[-1].finished

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_async_llm_with_restarts_heals_a_killed_engine_core(tiny_llama_dir):
    """AsyncLLM(max_engine_restarts=1) (off by default): the engine core SIGKILLed mid-stream
    is restarted and the stream ends as an uninterrupted one would, token for token."""
    import os
    import signal

    params = SamplingParams(temperature=0.9, seed=5, max_tokens=120, ignore_eos=True)
    offline = shardserve.LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)
    want = offline.generate(["hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    offline.shutdown()
    engine = shardserve.AsyncLLM.from_engine_args(shardserve.AsyncEngineArgs(
        model=str(tiny_llama_dir), dtype="float32", max_model_len=256, max_engine_restarts=1))
    first = engine._client.replicas.group.procs[0].proc.pid

    async def main() -> list[int]:
        last = None
        async for out in engine.generate("hello there", params, "a"):
            if last is None:
                os.kill(first, signal.SIGKILL)  # after its first output: mid-stream
            last = out
        assert last is not None and last.finished
        return last.outputs[0].token_ids

    try:
        assert asyncio.run(main()) == want
        assert engine._client.replicas.group.procs[0].proc.pid != first
    finally:
        engine.shutdown()
