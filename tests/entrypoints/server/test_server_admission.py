"""Admission control and the server's surface: --max-queued-requests answers 503 with
Retry-After once the engine's queue is full (and /metrics counts it), the API key comes from
SHARDSERVE_API_KEY too, an empty key is refused at start-up, --disable-fastapi-docs hides the
docs."""

from __future__ import annotations

import subprocess
import sys

import httpx
from server_helpers import TINY_ARGS, Server
from sync_helpers import HANG_S, frozen, wait_until
from test_server_faults import StreamReader, serve_one

SHORT = {"prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0}


def test_full_queue_answers_503_with_retry_after(tiny_llama_dir, tmp_path):
    # One request runs (max_num_seqs=1), one may wait; a third is refused.
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--max-num-seqs", "1",
                                     "--max-queued-requests", "1"], tmp_path / "server.log")
    try:
        engine = server.engine_process()
        serve_one(server)  # the same prompt as the readers': its token count is the unit
        per_request = server.metric("shardserve:prompt_tokens_total")
        with frozen(engine.pid):  # nothing finishes while the queue fills
            readers = [StreamReader(server) for _ in range(2)]
            wait_until(lambda: server.metric("shardserve:prompt_tokens_total")
                       >= 3 * per_request, "both requests to reach the engine client")
            resp = httpx.post(f"{server.url}/v1/completions", json=SHORT,
                              headers=server.headers, timeout=10)
            assert resp.status_code == 503, resp.text
            assert resp.headers["retry-after"] == "1"
            error = resp.json()["error"]
            assert "--max-queued-requests" in error["message"] and error["code"] == 503
            rejected = server.metric('shardserve:requests_rejected_total{reason="queue_full"}')
            assert rejected == 1.0
        for reader in readers:  # the admitted ones were not harmed
            reader.join(HANG_S)
            assert reader.finished_normally(), (reader.events[-1:], reader.failure)
        ok = httpx.post(f"{server.url}/v1/completions", json=SHORT, headers=server.headers,
                        timeout=30)
        assert ok.status_code == 200, ok.text
    finally:
        server.stop()
    assert not server.leftovers()


def test_api_key_from_the_environment_and_docs_disabled(tiny_llama_dir, tmp_path):
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--disable-fastapi-docs"],
                    tmp_path / "server.log", api_key=None, env={"SHARDSERVE_API_KEY": "envkey"})
    try:
        url = f"{server.url}/v1/completions"
        assert httpx.post(url, json=SHORT, timeout=30).status_code == 401
        ok = httpx.post(url, json=SHORT, headers={"Authorization": "Bearer envkey"}, timeout=30)
        assert ok.status_code == 200, ok.text
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 404, path
        assert "envkey" not in " ".join(server.proc.args)  # not visible in `ps`
    finally:
        server.stop()


def test_an_empty_api_key_is_refused_at_start_up(tiny_llama_dir):
    for extra, env in (([], {"SHARDSERVE_API_KEY": ""}), (["--api-key", " "], {})):
        proc = subprocess.run(
            [sys.executable, "-m", "shardserve", "serve", "--model", str(tiny_llama_dir),
             "--port", "1", *extra],
            capture_output=True, text=True, timeout=120, env={**__import__("os").environ, **env},
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "is empty" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_docs_are_served_by_default(tiny_server):
    assert httpx.get(f"{tiny_server.url}/openapi.json", timeout=10).status_code == 200

