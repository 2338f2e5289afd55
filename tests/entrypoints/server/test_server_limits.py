"""Per-request limits (ServerLimits): each request just over a limit gets a 400 (413 for the body)
naming the field, the value and the limit, and the server keeps serving afterwards."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_helpers import TINY_ARGS, Server

from shardserve.entrypoints.server.limits import ServerLimits

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
BODY_LIMIT = 1 << 20

# (endpoint, body, the field (param), words the message must contain: value and limit)
OVER_LIMIT = [
    (C, {"prompt": "x", "n": 129}, "n", ["n=129", "128", "--max-n"]),
    (C, {"prompt": "x", "n": 129, "best_of": 129}, "n", ["129", "128", "--max-n"]),
    (CHAT, {"messages": USER, "n": 1000}, "n", ["n=1000", "128", "--max-n"]),
    (C, {"prompt": ["x"] * 129}, "prompt", ["129 prompts", "128", "--max-prompts"]),
    (C, {"prompt": [[5]] * 129}, "prompt", ["129 prompts", "128", "--max-prompts"]),
    (C, {"prompt": ["x"] * 3, "n": 100}, "n", ["n=100", "3 prompts", "300", "256",
                                               "--max-choices"]),
    (C, {"prompt": "x", "stop": ["a"] * 17}, "stop", ["17 strings", "16", "--max-stop"]),
    (CHAT, {"messages": USER, "stop": "s" * 257}, "stop", ["257 characters", "256",
                                                         "--max-stop-len"]),
    (C, {"prompt": "x", "stop_token_ids": [3] * 129}, "stop_token_ids",
     ["129 ids", "128", "--max-stop-token-ids"]),
    (C, {"prompt": "x", "temperature": 1e39}, "temperature", ["1e+39", "100.0",
                                                              "--max-temperature"]),
    (CHAT, {"messages": USER, "temperature": 100.5}, "temperature", ["100.5", "100.0",
                                                                     "--max-temperature"]),
    (C, {"prompt": "x", "temperature": float("inf")}, "temperature", ["inf", "100.0"]),
    (C, {"prompt": "x", "temperature": float("nan")}, "temperature", ["nan", "100.0"]),
    (CHAT, {"messages": USER, "chat_template": TEMPLATE}, "chat_template",
     ["--trust-request-chat-template"]),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"chat_template": TEMPLATE}},
     "chat_template_kwargs.chat_template", ["--trust-request-chat-template"]),
]


@pytest.fixture()
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def strict_server(tiny_llama_dir, tmp_path_factory):
    """A server with a 1 MiB body limit that trusts clients' chat templates."""
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--max-request-body-bytes", str(BODY_LIMIT),
                                     "--trust-request-chat-template"],
                    tmp_path_factory.mktemp("limits") / "server.log")
    yield server
    server.stop()
    assert not server.leftovers()


def _assert_serves(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    ok = http.post(C, json={"prompt": "Hello", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1, ok.text


def _check(resp: httpx.Response, status: int, param: str | None, words: list[str]) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    for word in words:
        assert word in err["message"], (word, err["message"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body", "param", "words"), OVER_LIMIT,
                         ids=[f"{i}-{case[2]}" for i, case in enumerate(OVER_LIMIT)])
def test_over_a_limit_is_a_400_naming_it(http, path, body, param, words, stream):
    # json.dumps writes inf and nan as Infinity and NaN, which the server's parser reads
    resp = http.post(path, content=json.dumps({**body, "stream": stream}),
                     headers={"content-type": "application/json"})
    _check(resp, 400, param, words)
    _assert_serves(http)


def test_at_the_limits_is_served(http):
    body = {"prompt": "x", "max_tokens": 2, "stop": ["a" * 256] * 16,
            "stop_token_ids": [3] * 128, "temperature": 100.0, "n": 2}
    resp = http.post(C, json=body)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2, resp.text


def test_long_prompt_refused_without_tokenizing_it_all(http):
    """8 MiB of text (~8 M tokens): refused from a prefix, in far less time than tokenizing it."""
    for path, body, param in [(C, {"prompt": "ab " * ((8 << 20) // 3)}, "prompt"),
                              (CHAT, {"messages": [{"role": "user",
                                                    "content": "ab " * ((8 << 20) // 3)}]},
                               "messages")]:
        start = time.monotonic()
        resp = http.post(path, json=body)
        elapsed = time.monotonic() - start
        _check(resp, 400, param, ["max_model_len=512"])
        assert elapsed < 3.0, elapsed  # tokenizing it all takes ~6 s
    _assert_serves(http)


def test_body_over_the_limit_is_a_413(strict_server):
    with httpx.Client(base_url=strict_server.url, headers=strict_server.headers,
                      timeout=60) as http:
        resp = http.post(C, json={"prompt": "x" * (2 * BODY_LIMIT)})
        _check(resp, 413, None, [str(BODY_LIMIT), "--max-request-body-bytes"])
        _assert_serves(http)


def test_chunked_body_over_the_limit_is_a_413_and_health_answers_meanwhile(strict_server):
    health: list[int] = []

    def chunks():
        yield b'{"prompt": "'
        for _ in range(2 * BODY_LIMIT // 65536):
            yield b"x" * 65536
            if not health:  # mid-upload: the server answers other requests
                health.append(httpx.get(f"{strict_server.url}/health", timeout=10).status_code)
        yield b'"}'

    with httpx.Client(base_url=strict_server.url, headers=strict_server.headers,
                      timeout=60) as http:
        resp = http.post(C, content=chunks(), headers={"content-type": "application/json"})
        _check(resp, 413, None, [str(BODY_LIMIT), "--max-request-body-bytes"])
        assert health == [200]
        _assert_serves(http)


def test_trusted_chat_templates_are_used(strict_server):
    with httpx.Client(base_url=strict_server.url, headers=strict_server.headers,
                      timeout=60) as http:
        for extra in [{"chat_template": TEMPLATE},
                      {"chat_template_kwargs": {"chat_template": TEMPLATE}}]:
            resp = http.post(CHAT, json={"messages": USER, "max_tokens": 2, **extra})
            assert resp.status_code == 200, resp.text
            # The template renders only the content: no ChatML markers around "hi".
            assert resp.json()["usage"]["prompt_tokens"] < 4


def test_health_answers_while_a_prompt_is_prepared(strict_server):
    """Template rendering and tokenizing run off the event loop: a slow template (~3 s of
    rendering) leaves /health answering meanwhile."""
    slow = ("{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
            + TEMPLATE)
    url, headers = strict_server.url, strict_server.headers
    result: list[int] = []
    sender = threading.Thread(target=lambda: result.append(httpx.post(
        f"{url}{CHAT}", json={"messages": USER, "max_tokens": 2, "chat_template": slow},
        headers=headers, timeout=120).status_code))
    sender.start()
    time.sleep(0.3)  # the request has arrived and its rendering started
    answered, slowest = 0, 0.0
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        answered += sender.is_alive()
    sender.join()
    assert result == [200] and answered >= 1 and slowest < 1.0, (result, answered, slowest)


def test_bad_limit_flag_is_a_usage_error(tiny_llama_dir):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "shardserve", "serve", "--model", str(tiny_llama_dir),
         "--max-temperature", "inf", "--port", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--max-temperature" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"max_n": 0}, "--max-n"),
    ({"max_stop_len": 2.5}, "--max-stop-len"),
    ({"max_request_body_bytes": -1}, "--max-request-body-bytes"),
    ({"max_temperature": float("nan")}, "--max-temperature"),
    ({"max_temperature": 0}, "--max-temperature"),
])
def test_limits_name_the_bad_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ServerLimits(**kwargs)
