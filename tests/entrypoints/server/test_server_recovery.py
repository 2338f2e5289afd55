"""Replica recovery through the real server: an engine core SIGKILLed in the middle of streamed
requests is restarted and its requests continue (text equal to an uninterrupted run, no error
event, the server stays up); the restart bound, when reached, falls back to today's behaviour.

"In the middle" is made certain: the engine core is frozen (SIGSTOP) once each stream has its
first events, so the requests cannot finish before the kill lands, however loaded the machine.
"""

from __future__ import annotations

import json
import threading

import httpx
import psutil
from server_helpers import TINY_ARGS, Server
from sync_helpers import HANG_S, wait_until

BODY = {"prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0,
        "ignore_eos": True}


class Stream(threading.Thread):
    """One streamed completion: its text, error events and whether it finished."""

    def __init__(self, server: Server, body: dict) -> None:
        super().__init__(daemon=True)
        self.server, self.body = server, {**body, "stream": True}
        self.text, self.errors, self.finish, self.events = "", [], None, 0
        self.failure: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.server.url}/v1/completions", json=self.body,
                              headers=self.server.headers, timeout=HANG_S) as resp:
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    self.events += 1
                    if "error" in event:
                        self.errors.append(event["error"])
                    for choice in event.get("choices", []):
                        self.text += choice.get("text", "")
                        self.finish = choice.get("finish_reason") or self.finish
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.failure = e


def complete(server: Server, body: dict) -> str:
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers,
                      timeout=HANG_S)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def engine_cores(server: Server) -> list[psutil.Process]:
    return sorted((p for p in server.descendants() if "engine_core" in " ".join(p.cmdline())),
                  key=lambda p: " ".join(p.cmdline()))


def kill_cores_mid_stream(server: Server, bodies: list[dict], victims: int) -> list[Stream]:
    """Start one stream per body, freeze every engine core once each stream has begun, then
    SIGKILL the first `victims` cores and let the others go."""
    cores = engine_cores(server)
    streams = [Stream(server, b) for b in bodies]
    wait_until(lambda: all(s.events >= 2 or not s.is_alive() for s in streams),
               "every stream to begin")
    for core in cores:
        core.suspend()
    try:
        assert all(s.is_alive() for s in streams)
        for core in cores[:victims]:
            core.kill()
    finally:
        for core in cores[victims:]:
            core.resume()
    for s in streams:
        s.join(HANG_S)
    return streams


def assert_continued(streams: list[Stream], references: list[str]) -> None:
    for s, ref in zip(streams, references, strict=True):
        assert s.failure is None and not s.errors, (s.failure, s.errors)
        assert s.finish == "length"
        assert s.text == ref


def test_dp2_engine_core_killed_requests_continue(tiny_llama_dir, tmp_path):
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--data-parallel-size", "2"],
                    tmp_path / "server.log", api_key=None)
    try:
        bodies = [BODY, {**BODY, "prompt": "Once upon a time"},
                  {**BODY, "temperature": 0.8, "seed": 7}]
        references = [complete(server, b) for b in bodies]
        streams = kill_cores_mid_stream(server, bodies, victims=1)
        assert_continued(streams, references)
        wait_until(lambda: httpx.get(f"{server.url}/health").json()["status"] == "ok",
                   "the restarted replica to serve")
        assert complete(server, bodies[0]) == references[0]
        metrics = server.metrics()
        assert metrics['shardserve:engine_restarts_total{engine="0"}'] == 1
        assert metrics["shardserve:requests_migrated_total"] >= 1
        assert "engine core 0 died" in server.log() and "SIGKILL" in server.log()
    finally:
        server.stop()
    assert not server.leftovers()


def test_dp1_requests_wait_for_the_restart_until_the_bound_is_reached(tiny_llama_dir,
                                                                       tmp_path):
    """DP=1, --max-engine-restarts 1: the first death is healed (the open requests, greedy and
    seeded sampling, wait for the restarted replica and continue as if nothing happened), the
    second is the engine's death (open requests get the error, the server exits with status
    1). (The healing and the bound were a server each; the server's default bound, 5, is only
    a larger number, and the other tests here run on it.)"""
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--max-engine-restarts", "1"],
                    tmp_path / "server.log", api_key=None)
    try:
        bodies = [BODY, {**BODY, "temperature": 1.0, "top_p": 0.9, "seed": 3}]
        references = [complete(server, b) for b in bodies]
        assert_continued(kill_cores_mid_stream(server, bodies, victims=1), references)
        streams = kill_cores_mid_stream(server, [BODY], victims=1)
        assert streams[0].errors and "restart bound reached" in streams[0].errors[0]["message"]
        server.proc.wait(HANG_S)
        assert server.proc.returncode == 1
    finally:
        server.stop()
    assert not server.leftovers()


def test_no_replica_up_within_the_restart_timeout_is_a_clear_error(tiny_llama_dir, tmp_path):
    """DP=1, --engine-restart-timeout 0.2: the restart (a new process loading the model) takes
    longer, so the moved request and one sent meanwhile end with an error naming the option;
    once the replica is back, requests are served again."""
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--engine-restart-timeout", "0.2"],
                    tmp_path / "server.log", api_key=None)
    try:
        streams = kill_cores_mid_stream(server, [BODY], victims=1)
        late = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=HANG_S)
        assert streams[0].errors and "--engine-restart-timeout" in streams[0].errors[0]["message"]
        assert late.status_code == 503 and "--engine-restart-timeout" in late.text, late.text
        wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200,
                   "the replica to be back")
        assert complete(server, {**BODY, "max_tokens": 4})
    finally:
        server.stop()
    assert not server.leftovers()


def test_a_draining_replica_that_dies_is_not_restarted(tiny_llama_dir, tmp_path):
    """DP=2 scaled to 1 while replica 1 still runs a request; replica 1 then dies: its request
    moves to replica 0 and finishes as it would have, replica 1 is gone (no restart)."""
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--data-parallel-size", "2"],
                    tmp_path / "server.log")
    try:
        bodies = [BODY, {**BODY, "prompt": "Once upon a time"}]
        references = [complete(server, b) for b in bodies]
        cores = engine_cores(server)
        streams = [Stream(server, b) for b in bodies]
        wait_until(lambda: all(s.events >= 2 or not s.is_alive() for s in streams),
                   "every stream to begin")
        resp = httpx.post(f"{server.url}/scale", json={"data_parallel_size": 1},
                          headers=server.headers, timeout=HANG_S)
        assert resp.json() == {"data_parallel_size": 1, "replicas": [0]}, resp.text
        assert all(s.is_alive() for s in streams)  # replica 1 drains its request
        cores[1].kill()
        for s in streams:
            s.join(HANG_S)
        assert_continued(streams, references)
        assert "died while it drained" in server.log()
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        assert server.metrics().get('shardserve:engine_restarts_total{engine="1"}', 0) == 0
    finally:
        server.stop()
    assert not server.leftovers()
