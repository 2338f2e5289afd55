"""Faults and shutdown: a SIGKILLed worker (mp) or engine process turns /health to 503 and ends
in-flight requests with an error within 2 s; SIGTERM / SIGINT stop everything within 5 s and leave
no process or shared-memory segment behind."""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from server_helpers import TINY_ARGS, Server, shm_segments

LONG = {"prompt": "The quick brown fox", "max_tokens": 480, "temperature": 0,
        "ignore_eos": True, "stream": True}


class StreamReader(threading.Thread):
    """Reads one streaming completion; records its events, an error event, and when it ended."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.events: list[dict] = []
        self.error: dict | None = None
        self.ended_at: float | None = None
        self.failure: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.server.url}/v1/completions", json=LONG,
                              headers=self.server.headers, timeout=30) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        self.error = event.get("error", self.error)
                        self.events.append(event)
        except Exception as e:  # the connection may be cut at shutdown
            self.failure = e
        self.ended_at = time.monotonic()

    def wait_for_tokens(self, n: int = 3, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.events) < n and time.monotonic() < deadline and self.is_alive():
            time.sleep(0.01)
        assert len(self.events) >= n, (self.events, self.failure)


def engine_process(server: Server) -> psutil.Process:
    for p in server.descendants():
        if "engine_core" in " ".join(p.cmdline()):
            return p
    raise AssertionError([p.cmdline() for p in server.descendants()])


def assert_dead_within(server: Server, reader: StreamReader, t0: float, limit_s: float) -> None:
    reader.join(limit_s + 5)
    assert reader.ended_at is not None, "the in-flight request hangs"
    assert reader.error is not None, (reader.events[-1:], reader.failure)
    assert reader.error["code"] == 503
    assert any(w in reader.error["message"] for w in ("died", "exited", "failed"))
    assert reader.ended_at - t0 < limit_s, reader.ended_at - t0
    resp = httpx.get(f"{server.url}/health", timeout=5)
    assert resp.status_code == 503 and resp.json()["error"]["message"]
    body = {k: v for k, v in LONG.items() if k != "stream"}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers,
                      timeout=5)
    assert resp.status_code == 503 and resp.json()["error"]["type"]


def test_mp_worker_sigkill_ends_requests_with_error(tiny_llama_dir, tmp_path):
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--tensor-parallel-size", "2"],
                    tmp_path / "server.log")
    try:
        workers = engine_process(server).children()
        workers = [w for w in workers if "TP" in " ".join(w.cmdline()) or
                   "worker" in " ".join(w.cmdline())]
        assert len(workers) == 2, [w.cmdline() for w in workers]
        reader = StreamReader(server)
        reader.wait_for_tokens()
        t0 = time.monotonic()
        os.kill(workers[1].pid, signal.SIGKILL)
        assert_dead_within(server, reader, t0, 2.0)
    finally:
        elapsed = server.stop()
    assert elapsed < 5
    assert not shm_segments() - server.shm_before


def test_engine_process_sigkill_is_noticed(tiny_llama_dir, tmp_path):
    server = Server(tiny_llama_dir, TINY_ARGS, tmp_path / "server.log", api_key=None)
    try:
        reader = StreamReader(server)
        reader.wait_for_tokens()
        t0 = time.monotonic()
        engine_process(server).kill()
        assert_dead_within(server, reader, t0, 2.0)
    finally:
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_everything_within_5s(tiny_llama_dir, tmp_path, sig):
    server = Server(tiny_llama_dir, TINY_ARGS, tmp_path / "server.log")
    reader = StreamReader(server)
    reader.wait_for_tokens()
    assert len(server.descendants()) >= 1
    elapsed = server.stop(sig)  # asserts that no process is left
    assert elapsed < 5, elapsed
    assert server.proc.returncode in (0, 130, -sig), (server.proc.returncode, server.log())
    assert not shm_segments() - server.shm_before
    reader.join(5)
    assert reader.ended_at is not None


def test_engine_exits_when_the_api_server_dies(tiny_llama_dir, tmp_path):
    """The death pipe: with the API server SIGKILLed (no cleanup at all), the engine process
    notices EOF and exits, mid-generation, on its own."""
    before = set(glob.glob("/tmp/shardserve-server-*"))
    server = Server(tiny_llama_dir, TINY_ARGS, tmp_path / "server.log", api_key=None)
    engine = engine_process(server)
    socket_dirs = set(glob.glob("/tmp/shardserve-server-*")) - before
    assert socket_dirs
    reader = StreamReader(server)
    reader.wait_for_tokens()
    server.proc.kill()
    try:
        engine.wait(5)
    except psutil.TimeoutExpired:
        engine.kill()
        raise AssertionError("the engine process outlived the API server by 5 s") from None
    finally:
        server.stop()
    assert not socket_dirs & set(glob.glob("/tmp/shardserve-server-*"))  # the engine removed it
