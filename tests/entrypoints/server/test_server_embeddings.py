"""/v1/embeddings on a `--runner pooling` server, through the official openai client: float and
base64 encodings equal offline LLM.embed; strings, token ids and lists of either; usage; and
the refusals (dimensions, generation endpoints on a pooling server, embeddings on a generate
server) answer 400 naming the problem."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from server_helpers import API_KEY, TINY_ARGS, Server

from shardserve import LLM

MODEL = "emb-model"
TEXTS = ["The quick brown fox jumps over the lazy dog", "hello", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def pooling_server(tiny_llama_dir, tmp_path_factory):
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--runner", "pooling", "--kv-cache-memory-bytes",
                                     str(1 << 22),
                                     "--served-model-name", MODEL],
                    tmp_path_factory.mktemp("srv-embed") / "server.log")
    yield server
    server.stop()
    assert not server.leftovers()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    """LLM.embed with the server's options: the reference vectors, and the prompts' ids."""
    llm = LLM(str(tiny_llama_dir), runner="pooling", dtype="float32", max_model_len=512,
              kv_cache_memory_bytes=1 << 22)
    outs = llm.embed(TEXTS, use_tqdm=False)
    llm.shutdown()
    return [np.asarray(o.outputs.embedding, dtype=np.float32) for o in outs], \
        [o.prompt_token_ids for o in outs]


@pytest.fixture()
def embed_client(pooling_server):
    with openai.OpenAI(base_url=f"{pooling_server.url}/v1", api_key=API_KEY, max_retries=0,
                       timeout=60) as c:
        yield c


def _close(a, b) -> bool:
    return np.allclose(np.asarray(a, dtype=np.float32), b, atol=1e-5)


def test_float_and_base64_equal_offline(embed_client, offline):
    want, ids = offline
    res = embed_client.embeddings.create(model=MODEL, input=TEXTS,
                                         encoding_format="float", user="u1")
    assert [d.index for d in res.data] == [0, 1, 2]
    assert all(_close(d.embedding, w) for d, w in zip(res.data, want, strict=True))
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    raw = embed_client.embeddings.create(model=MODEL, input=TEXTS[0],
                                         encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    assert _close(decoded, want[0])
    # Without encoding_format the client asks for base64 and decodes it itself.
    plain = embed_client.embeddings.create(model=MODEL, input=[TEXTS[1]])
    assert _close(plain.data[0].embedding, want[1])


def test_token_id_inputs(embed_client, offline):
    want, ids = offline
    one = embed_client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert _close(one.data[0].embedding, want[0])
    many = embed_client.embeddings.create(model=MODEL, input=ids[1:], encoding_format="float")
    assert all(_close(d.embedding, w) for d, w in zip(many.data, want[1:], strict=True))


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60)


def test_refusals_answer_400_naming_the_problem(pooling_server, embed_client):
    with pytest.raises(openai.BadRequestError, match="dimensions=8 is not supported"):
        embed_client.embeddings.create(model=MODEL, input="hi", dimensions=8)
    r = _post(pooling_server, "/v1/embeddings", {"input": "hi", "encoding_format": "int8"})
    assert r.status_code == 400 and "encoding_format" in r.text
    assert _post(pooling_server, "/v1/embeddings", {"input": []}).status_code == 400
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = _post(pooling_server, path, {"model": MODEL, "prompt": "hi",
                                         "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400, r.text
        assert "--runner pooling" in r.json()["error"]["message"]
        assert "/v1/embeddings" in r.json()["error"]["message"]
    # The API key still comes first.
    assert httpx.post(f"{pooling_server.url}/v1/completions", json={}).status_code == 401


def test_embeddings_on_a_generate_server_answer_400(tiny_server):
    r = _post(tiny_server, "/v1/embeddings", {"input": "hi"})
    assert r.status_code == 400
    assert "--runner pooling" in r.json()["error"]["message"]
