"""Live re-scaling and sleep through the server: 1 -> 2 -> 1 replicas under 32 concurrent
streaming clients loses and duplicates nothing, /metrics follows the replica count; the admin
endpoints are authenticated; a sleeping engine refuses requests until woken."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_helpers import API_KEY, TINY_ARGS, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CLIENTS = 32
TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    srv = Server(tiny_llama_dir, TINY_ARGS, tmp_path_factory.mktemp("scale") / "server.log")
    yield srv
    srv.stop()
    assert not srv.leftovers()


def replica_gauges(srv: Server) -> set[str]:
    return {k.split('engine="')[1].split('"')[0] for k in srv.metrics()
            if k.startswith("shardserve:num_requests_running{")}


def test_scale_1_2_1_under_streaming_clients(server) -> None:
    results: list[tuple[str, int, str | None]] = []
    stop = asyncio.Event()
    seen_busy_replica_1 = []

    async def client(api: openai.AsyncOpenAI, name: str, k: int) -> None:
        while not stop.is_set():
            stream = await api.completions.create(
                model=name, prompt=f"client {k} says", max_tokens=TOKENS, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            rid, finish, usage = None, None, 0
            async for chunk in stream:
                rid = chunk.id
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            results.append((rid, usage, finish))

    async def admin(http: httpx.AsyncClient) -> None:
        async def scale(size: int) -> dict:
            r = await http.post(f"{server.url}/scale", json={"data_parallel_size": size},
                                headers=AUTH, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        await wait_for_results(8)
        assert (await scale(2)) == {"data_parallel_size": 2, "replicas": [0, 1]}
        assert server.metric("shardserve:data_parallel_size") == 2
        assert replica_gauges(server) == {"0", "1"}
        start, deadline = len(results), time.monotonic() + 60
        # Both replicas serve for a while, until replica 1 has been seen running requests.
        while len(results) < start + 3 * CLIENTS or not any(seen_busy_replica_1):
            assert time.monotonic() < deadline, "replica 1 was never seen running a request"
            await asyncio.sleep(0.02)
            busy = server.metric('shardserve:num_requests_running{engine="1"}', 0)
            seen_busy_replica_1.append(busy)
        assert (await scale(1)) == {"data_parallel_size": 1, "replicas": [0]}
        assert server.metric("shardserve:data_parallel_size") == 1
        deadline = time.monotonic() + 60  # replica 1 finishes its requests, then leaves
        while replica_gauges(server) != {"0"}:
            assert time.monotonic() < deadline, (replica_gauges(server), server.log()[-3000:])
            await asyncio.sleep(0.1)
        start = len(results)
        await wait_for_results(start + CLIENTS)
        stop.set()

    async def wait_for_results(n: int) -> None:
        while len(results) < n:
            await asyncio.sleep(0.05)

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120) as api, \
                httpx.AsyncClient() as http:
            name = (await api.models.list()).data[0].id
            await asyncio.wait_for(asyncio.gather(
                admin(http), *(client(api, name, k) for k in range(CLIENTS))), 300)

    asyncio.run(main())
    ids = [rid for rid, _, _ in results]
    assert len(ids) == len(set(ids)), "a request was answered twice"
    assert all(tokens == TOKENS and finish == "length" for _, tokens, finish in results)
    print(f"\n{len(results)} streamed requests across 1 -> 2 -> 1 replicas, none lost")


def test_admin_endpoints_need_the_key(server) -> None:
    r = httpx.post(f"{server.url}/scale", json={"data_parallel_size": 2}, timeout=30)
    assert r.status_code == 401
    r = httpx.post(f"{server.url}/scale", json={"data_parallel_size": 0}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 400 and "data_parallel_size=0" in r.json()["error"]["message"]


def test_sleep_refuses_requests_until_woken(server) -> None:
    completion = {"model": "x", "prompt": "hello", "max_tokens": 2}
    post = lambda path, **kw: httpx.post(f"{server.url}{path}", headers=AUTH,  # noqa: E731
                                         timeout=60, **kw)
    name = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    completion["model"] = name
    assert post("/sleep", params={"level": 1}).status_code == 200
    state = httpx.get(f"{server.url}/is_sleeping", headers=AUTH, timeout=30).json()
    assert state["is_sleeping"] is True
    r = post("/v1/completions", json=completion)
    assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
    assert post("/wake_up").status_code == 200
    assert httpx.get(f"{server.url}/is_sleeping", headers=AUTH).json()["is_sleeping"] is False
    assert post("/v1/completions", json=completion).status_code == 200


def test_admin_refused_without_an_api_key(tiny_llama_dir, tmp_path) -> None:
    srv = Server(tiny_llama_dir, TINY_ARGS, tmp_path / "server.log", api_key=None)
    try:
        r = httpx.post(f"{srv.url}/scale", json={"data_parallel_size": 2}, timeout=30)
        assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
    finally:
        srv.stop()


