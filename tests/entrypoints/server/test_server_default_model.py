"""The default model (float32) through the server: greedy text equals offline LLM.generate / chat,
streamed and not, with the requests in flight together."""

from __future__ import annotations

import asyncio

import openai
import pytest
from server_helpers import API_KEY, Server

from shardserve import SamplingParams

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,",
           "def fibonacci(n):"]
ARGS = ["--dtype", "float32", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    srv = Server(None, ARGS, tmp_path_factory.mktemp("srv") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(default_model_path):
    from shardserve import LLM

    llm = LLM(dtype="float32", max_model_len=512)
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_default_model_greedy_equal_offline(server, offline):
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [r.outputs[0].text for r in offline.generate(PROMPTS, params, use_tqdm=False)]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ref = offline.chat(messages, params, use_tqdm=False)[0].outputs[0].text

    async def run() -> tuple[list[str], list[str], str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120) as client:
            name = (await client.models.list()).data[0].id

            async def plain(p: str) -> str:
                r = await client.completions.create(model=name, prompt=p, max_tokens=16,
                                                    temperature=0)
                return r.choices[0].text

            async def streamed(p: str) -> str:
                s = await client.completions.create(model=name, prompt=p, max_tokens=16,
                                                    temperature=0, stream=True)
                return "".join([c.choices[0].text async for c in s])

            async def chat() -> str:
                s = await client.chat.completions.create(model=name, messages=messages,
                                                         max_tokens=16, temperature=0,
                                                         stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in s])

            results = await asyncio.wait_for(asyncio.gather(
                asyncio.gather(*map(plain, PROMPTS)), asyncio.gather(*map(streamed, PROMPTS)),
                chat()), 150)
            return results[0], results[1], results[2]

    plain, streamed, chat = asyncio.run(run())
    assert plain == expected
    assert streamed == expected
    assert chat == chat_ref
