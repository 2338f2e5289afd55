"""The server with two data-parallel replicas (`--data-parallel-size 2`): float32 greedy text of
the HF oracle's prompts, all in flight together, equals HF transformers' greedy continuation;
/metrics shows both replicas' gauges and the replica count, and both served requests."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import openai
import pytest
from server_helpers import API_KEY, Server

from shardserve.model.loader import load_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1]))
from pp_oracle import oracle_prompt_ids  # noqa: E402

ARGS = ["--dtype", "float32", "--max-model-len", "512", "--data-parallel-size", "2"]


@pytest.fixture(scope="module")
def dp_server(default_model_path, tmp_path_factory):
    srv = Server(None, ARGS, tmp_path_factory.mktemp("srv") / "server.log")
    yield srv
    srv.stop()
    assert not srv.leftovers()


@pytest.mark.slow
def test_dp2_server_greedy_matches_hf(dp_server, hf_default_greedy, default_model_path):
    tok = load_tokenizer(default_model_path)
    prompts = oracle_prompt_ids(tok)
    expected = [tok.decode(hf_default_greedy(ids), skip_special_tokens=True)
                for ids in prompts]

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{dp_server.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120) as client:
            name = (await client.models.list()).data[0].id

            async def one(ids: list[int]) -> str:
                r = await client.completions.create(model=name, prompt=ids, max_tokens=32,
                                                    temperature=0)
                return r.choices[0].text

            return await asyncio.gather(*(one(ids) for ids in prompts))

    before = dp_server.metrics()
    assert before["shardserve:data_parallel_size"] == 2
    assert asyncio.run(run()) == expected
    after = dp_server.metrics()
    for engine in ("0", "1"):
        assert after[f'shardserve:num_requests_running{{engine="{engine}"}}'] == 0
    # The replicas report prefix-cache lookups of every prompt token; /metrics sums them.
    assert after["shardserve:prefix_cache_queries_total"] >= sum(len(p) for p in prompts) - 8
