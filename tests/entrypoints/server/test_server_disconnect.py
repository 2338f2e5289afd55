"""A client that leaves mid-request aborts it: the engine drops it and frees its KV blocks.

The tiny model finishes 480 tokens in well under a second, so "leave while it generates" must not
be left to the machine's speed. This server's worker (gate_worker.GatedWorker, mp backend) runs
a model step only when the test allows it: the request generates a few tokens, then waits at the
gate, provably unfinished, while the client leaves. Afterwards the gate lets through far more
steps than an aborted request needs, but fewer than the request would take to finish, so an
abort that never reached the engine shows as a request still running at the gate.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from server_helpers import TINY_ARGS, Server, StepGate
from sync_helpers import wait_until

MAX_TOKENS = 480
BODY = {"prompt": "The engine schedules requests", "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True}
# After the abort: all but the last few steps the request would need to finish. The abort
# arrives within a step or two; a lost one leaves the request waiting at the gate.
SHORT_OF_THE_END = 5
ABORTED = 'shardserve:request_success_total{finished_reason="abort"}'
LENGTH = 'shardserve:request_success_total{finished_reason="length"}'


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> StepGate:
    return StepGate(tmp_path_factory.mktemp("gate") / "steps")


@pytest.fixture(scope="module")
def gated_server(tiny_llama_dir, gate, tmp_path_factory):
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--distributed-executor-backend", "mp",
                                     "--worker-cls", "gate_worker.GatedWorker"],
                    tmp_path_factory.mktemp("gated") / "server.log", env=gate.env)
    yield server
    gate.open()
    server.stop()
    assert not server.leftovers()


def _idle(server: Server) -> bool:
    m = server.metrics()
    return (m['shardserve:num_requests_running{engine="0"}'] == 0
            and m['shardserve:num_requests_waiting{engine="0"}'] == 0
            and m['shardserve:kv_cache_usage_perc{engine="0"}'] == 0)


def _run_and_leave(server: Server, gate: StepGate, leave) -> None:
    """Let the open request generate a few tokens, check it holds KV blocks, call `leave()`
    (which closes the client's connection), then check that the abort reached the engine."""
    before = server.metrics()
    allowed = gate.allow(3)  # prefill and two decode steps; then it waits at the gate
    wait_until(lambda: server.metric("shardserve:generation_tokens_total")
               > before.get("shardserve:generation_tokens_total", 0), "the first token")
    m = server.metrics()
    assert 1 <= gate.started() <= allowed  # the gated worker runs the steps
    assert m['shardserve:num_requests_running{engine="0"}'] == 1
    assert m['shardserve:kv_cache_usage_perc{engine="0"}'] > 0
    leave()
    wait_until(lambda: server.metric(ABORTED, 0) == before.get(ABORTED, 0) + 1,
               "the server to abort the request of the client that left")
    total = gate.allow(MAX_TOKENS - gate.started() - SHORT_OF_THE_END)
    # Bounded by the gate: a request whose abort was lost runs until the gate stops it.
    wait_until(lambda: _idle(server) or gate.started() >= total,
               "the engine to drop the request or reach the gate")
    assert gate.started() < total, "the engine ran until the gate stopped it: no abort arrived"
    assert _idle(server)  # and freed its KV blocks
    after = server.metrics()
    assert after.get(LENGTH, 0) == before.get(LENGTH, 0)  # it never finished


def test_stream_disconnect_aborts_and_frees_kv(gated_server, gate):
    gate.hold()
    try:
        with httpx.Client(timeout=60, headers=gated_server.headers) as http, \
                http.stream("POST", f"{gated_server.url}/v1/completions",
                            json=BODY | {"stream": True}) as resp:
            assert resp.status_code == 200
            # Leaving this block closes the stream's connection mid-generation.
            _run_and_leave(gated_server, gate, leave=resp.close)
    finally:
        gate.open()


def test_non_streaming_disconnect_aborts(gated_server, gate):
    gate.hold()
    body = json.dumps(BODY).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Authorization: Bearer {gated_server.api_key}\r\n\r\n").encode()
    # A plain socket: the test decides exactly when the client goes away.
    sock = socket.create_connection(("127.0.0.1", gated_server.port), timeout=60)
    try:
        sock.sendall(head + body)
        _run_and_leave(gated_server, gate, leave=sock.close)
    finally:
        sock.close()
        gate.open()
