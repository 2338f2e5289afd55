"""200 malformed or invalid requests: each gets a 4xx in OpenAI's error format with a message that
names the problem, the server keeps serving, and a valid request afterwards succeeds."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (endpoint, body (dict, or raw text for bad JSON), status, a word the message must contain)
RAW_CASES = [
    (C, "{", 400, "JSON"),
    (C, '{"prompt": }', 400, "JSON"),
    (C, "", 400, "body"),
    (C, "[1]", 400, "body"),
    (CHAT, "[1, 2", 400, "JSON"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}],}', 400, "JSON"),
    (C, "\xff\xfe", 400, "JSON"),
]
FIELD_CASES = [
    # wrong types
    (C, {"prompt": 5}, "prompt"),
    (C, {"prompt": [1.5]}, "prompt"),
    (C, {"prompt": {"a": 1}}, "prompt"),
    (C, {"prompt": None}, "prompt"),
    (C, {}, "prompt"),
    (C, {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    (C, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (C, {"prompt": "x", "n": "2"}, "n"),
    (C, {"prompt": "x", "n": True}, "n"),
    (C, {"prompt": "x", "stream": "yes"}, "stream"),
    (C, {"prompt": "x", "stop": 5}, "stop"),
    (C, {"prompt": "x", "stop": [1]}, "stop"),
    (C, {"prompt": "x", "seed": "s"}, "seed"),
    (C, {"prompt": "x", "logprobs": "x"}, "logprobs"),
    (C, {"prompt": "x", "stream_options": 1, "stream": True}, "stream_options"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [1]}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "role"),
    (CHAT, {"messages": [{"content": "x"}]}, "role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "content"),
    (CHAT, {"messages": USER, "logprobs": 3}, "logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": "x"}, "max_completion_tokens"),
    # out of range (SamplingParams' messages)
    (C, {"prompt": "x", "temperature": -1}, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, "top_p"),
    (C, {"prompt": "x", "n": 0}, "n"),
    (C, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -5}, "max_tokens"),
    (C, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    (C, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (C, {"prompt": "x", "top_k": -2}, "top_k"),
    (C, {"prompt": "x", "min_p": 2}, "min_p"),
    (C, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"messages": USER, "temperature": 9e999}, "temperature"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 25}, "logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens"),
    # too long, empty, unsupported
    (C, {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 512}, "max_tokens"),  # 1 token + 512 > 512
    (CHAT, {"messages": USER, "max_completion_tokens": 10**9}, "max_tokens"),
    (C, {"prompt": list(range(3, 603))}, "prompt"),
    (C, {"prompt": [10**6]}, "prompt"),
    (C, {"prompt": []}, "prompt"),
    (C, {"prompt": [[]]}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    (C, {"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": 101.0}}, "logit_bias"),
    (C, {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    (C, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.fixture()
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=30) as c:
        yield c


def _check_error(resp: httpx.Response, status: int, word: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["code"] == status and err["type"] and err["message"]
    assert word.lower() in err["message"].lower(), err["message"]


def _cases():
    """Every case, with each field case also sent as a stream and under the model's name:
    bounded, deterministic, and at least 200 in all."""
    cases = [(path, body, status, word) for path, body, status, word in RAW_CASES]
    for path, body, word in FIELD_CASES:
        cases.append((path, body, 400, word))
        if word not in ("stream", "stream_options"):  # streaming would make those valid
            cases.append((path, {**body, "stream": True}, 400, word))
        cases.append((path, {**body, "model": "MODEL"}, 400, word))
    for i in range(8):
        cases.append((C if i % 2 else CHAT, {"prompt": "x", "messages": USER,
                                             "model": f"no-such-model-{i}"}, 404, "model"))
    return cases


def test_200_invalid_requests_then_a_valid_one(http, tiny_server):
    name = http.get("/v1/models").json()["data"][0]["id"]
    cases = list(itertools.islice(itertools.cycle(_cases()), max(200, len(_cases()))))
    assert len(cases) >= 200
    for path, body, status, word in cases:
        if isinstance(body, dict):
            body = {k: (name if v == "MODEL" else v) for k, v in body.items()}
            resp = http.post(path, content=json.dumps(body),
                             headers={"content-type": "application/json"})
        else:
            resp = http.post(path, content=body.encode("latin-1"),
                             headers={"content-type": "application/json"})
        _check_error(resp, status, word)
    assert http.get("/health").status_code == 200
    ok = http.post(C, json={"model": name, "prompt": "Hello", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    ok = http.post(CHAT, json={"model": name, "messages": USER, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_unknown_route_and_method(http):
    resp = http.get("/v1/nothing")
    assert resp.status_code == 404 and resp.json()["error"]["message"]
    assert http.get(C).status_code == 405


def test_serve_refuses_external_launcher(tiny_llama_dir):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "shardserve", "serve", "--model", str(tiny_llama_dir),
         "--distributed-executor-backend", "external_launcher", "--port", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and "'mp'" in proc.stderr
    assert "Traceback" not in proc.stderr
