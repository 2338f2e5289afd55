"""Bounded memory per request whatever the client's reading speed: 4 streaming requests of
1,000 tokens with 5 logprobs each, from clients that read nothing until the engine has
finished them all, grow the API server's memory by no more than their own state
(measured: +50 MiB with 20 logprobs, the cumulative logprobs themselves), and every client then
gets all its tokens.

Note: the queue this replaced measured the same here (the kernel's socket buffers, megabytes on
loopback, absorbed the stalled streams before the server's stream loop blocked), so the
one-pending-output guarantee itself is shown by test_output_collector_keeps_one_output below.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import psutil
import pytest
from server_helpers import Server
from sync_helpers import wait_until

TOKENS = 1000
STALL_S = 1.0  # then each reader waits for `go`, set once the engine has finished all four
LIMIT_S = 240.0  # a hang-catcher: 4 x 1,000 tokens take ~5-30 s on a loaded 2-core machine
FINISHED = 'shardserve:request_success_total{finished_reason="length"}'


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, tiny_model_builder):
    return tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("tiny_8k"),
                              max_position_embeddings=8192)  # fmt: skip


class SlowReader(threading.Thread):
    """Sends a streaming request, then reads nothing for stall_s seconds and until `go`."""

    def __init__(self, server: Server, stall_s: float, go: threading.Event | None = None,
                 tokens: int = TOKENS) -> None:
        super().__init__(daemon=True)
        self.server, self.stall_s, self.max_tokens = server, stall_s, tokens
        self.go = go or threading.Event()
        if go is None:
            self.go.set()
        self.tokens = 0
        self.finish: str | None = None
        self.failure: Exception | None = None
        self.start()

    def run(self) -> None:
        body = {"prompt": "The quick brown fox", "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": 5}
        # A small receive buffer (64 KiB against the ~2 MiB a stream sends), so that a client
        # that does not read stops the server's stream early (as a slow client far away
        # would), not after megabytes. (16 KiB drained at the pace of TCP's zero-window
        # probes, which back off during the stall: ~30 s of reading.)
        small = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)]
        try:
            with httpx.Client(transport=httpx.HTTPTransport(socket_options=small),
                              timeout=LIMIT_S) as http, \
                    http.stream("POST", f"{self.server.url}/v1/completions", json=body,
                                headers=self.server.headers) as resp:
                time.sleep(self.stall_s)  # headers read; the body waits in the socket
                self.go.wait(LIMIT_S)
                # Now read at full speed.
                sock = resp.extensions["network_stream"].get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        self.tokens += len(choice["logprobs"]["tokens"])
                        self.finish = choice.get("finish_reason") or self.finish
        except Exception as e:
            self.failure = e


def test_slow_clients_do_not_grow_the_servers_memory(long_model, tmp_path):
    server = Server(long_model, ["--dtype", "float32", "--max-model-len", "8192"],
                    tmp_path / "server.log")
    try:
        api = psutil.Process(server.proc.pid)
        # Warm: first-request allocations (imports, caches) happen before the baseline.
        SlowReader(server, 0, tokens=200).join(LIMIT_S)
        before = api.memory_info().rss
        go = threading.Event()
        readers = [SlowReader(server, STALL_S, go) for _ in range(4)]
        # Measured once the engine has finished all four: everything now waits for readers.
        wait_until(lambda: server.metric(FINISHED, 0.0) >= 5, "the engine to finish", LIMIT_S)
        during = api.memory_info().rss
        assert all(r.is_alive() and r.tokens == 0 for r in readers)  # nothing read yet
        go.set()
        for r in readers:
            r.join(LIMIT_S)
        growth_mib = (during - before) / 2**20
        print(f"API server RSS: {before / 2**20:.0f} MiB before, +{growth_mib:.1f} MiB with "
              f"4 x {TOKENS} tokens waiting for stalled readers")
        for r in readers:
            assert r.failure is None and r.finish == "length", (r.failure, r.finish)
            assert r.tokens == TOKENS
        # One output per request: ~4 x 1,000 x (a token, its text, 5 logprobs) is a few MiB;
        # one output per step (what a queue keeps) would be hundreds of MiB.
        assert growth_mib < 64, growth_mib
    finally:
        server.stop()


def test_output_collector_keeps_one_output():
    """A request holds the newest untaken output only; an error replaces it and sticks."""
    import asyncio

    from shardserve.engine.async_outputs import OutputCollector
    from shardserve.errors import EngineDeadError
    from shardserve.outputs import RequestOutput

    def output(n: int) -> RequestOutput:
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[],
                             finished=n == 3)

    async def scenario() -> None:
        collector = OutputCollector()
        for n in range(1, 4):  # three steps while the client reads nothing
            collector.put(output(n))
        assert (await collector.get()).finished  # only the newest is there
        collector.put(output(4))
        collector.put(EngineDeadError("gone"))
        collector.put(output(5))  # after an error: ignored
        for _ in range(2):
            with pytest.raises(EngineDeadError):
                await collector.get()

    asyncio.run(scenario())
