"""vLLM's server surface beyond the completions: `serve MODEL` positional, --chat-template (file
or text), /tokenize, /detokenize, /v1/models/{id}, /ping, echo on completions, and the periodic
stats line."""

from __future__ import annotations

import time

import httpx
import pytest
from server_helpers import TINY_ARGS, Server
from test_server_api import model_name

from shardserve.entrypoints import cli

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}<go>"


def test_tokenize_detokenize_round_trip(tiny_server, tiny_offline):
    tok = tiny_offline.get_tokenizer()
    body = {"prompt": "The quick brown fox", "return_token_strs": True}
    got = httpx.post(f"{tiny_server.url}/tokenize", json=body, timeout=30).json()
    ids = tok.encode("The quick brown fox")
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 512
    assert got["token_strs"] == tok.convert_ids_to_tokens(ids)
    back = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": ids}, timeout=30).json()
    assert back == {"prompt": tok.decode(ids)}
    chat = httpx.post(f"{tiny_server.url}/tokenize", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    bad = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": [10**7]}, timeout=30)
    assert bad.status_code == 400 and "10000000" in bad.json()["error"]["message"]
    both = httpx.post(f"{tiny_server.url}/tokenize", timeout=30,
                      json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert both.status_code == 400


def test_models_retrieve_and_ping(client, tiny_server):
    name = model_name(tiny_server)
    assert client.models.retrieve(name).id == name
    missing = httpx.get(f"{tiny_server.url}/v1/models/nope", headers=tiny_server.headers,
                        timeout=30)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{tiny_server.url}/ping", timeout=30).status_code == 200


def test_echo_puts_the_prompt_first(client, tiny_server, tiny_offline):
    name = model_name(tiny_server)
    plain = client.completions.create(model=name, prompt="Hello there", max_tokens=5,
                                      temperature=0)
    echoed = client.completions.create(model=name, prompt="Hello there", max_tokens=5,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    stream = client.completions.create(model=name, prompt="Hello there", max_tokens=5,
                                       temperature=0, echo=True, stream=True)
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0] == "Hello there" and "".join(texts) == echoed.choices[0].text


def test_serve_model_positionally_with_a_chat_template_file(tiny_llama_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    server = Server(None, [str(tiny_llama_dir), *TINY_ARGS, "--chat-template", str(template)],
                    tmp_path / "server.log", env={"SHARDSERVE_LOG_STATS_INTERVAL_S": "0.2"})
    try:
        got = httpx.post(f"{server.url}/tokenize", timeout=30,
                         json={"messages": [{"role": "user", "content": "hi"}]}).json()
        tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "[user]hi<go>",
                                                         "add_special_tokens": False},
                         timeout=30).json()
        assert got["tokens"] == tok["tokens"]
        body = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers,
                          timeout=60).status_code == 200
        time.sleep(0.6)  # two stats intervals after the request
    finally:
        server.stop()
    # vLLM's periodic line (the --stream-interval test checks --disable-log-stats)
    assert "Avg generation throughput" in server.log()


@pytest.mark.parametrize(("argv", "words"), [
    (["a", "--model", "b"], ["given twice", "'a'", "'b'"]),
    (["--chat-template", "/no/such/template.jinja"], ["--chat-template", "no such file"]),
])
def test_bad_serve_arguments_are_refused(argv, words, capsys):
    assert cli.main(["serve", *argv]) == 2  # refused before any engine starts
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
