"""Fixtures: one tiny-model server shared by the session (start-up costs a few seconds), and
the offline engine with the same options for reference outputs. Tests that kill or stop a server,
or hold its model steps, start their own (see server_helpers.Server).
"""

from __future__ import annotations

import pytest
from server_helpers import API_KEY, TINY_ARGS, Server


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--enable-auto-tool-choice",
                                     "--tool-call-parser", "hermes"],
                    tmp_path_factory.mktemp("srv") / "server.log")
    yield server
    server.stop()
    assert not server.leftovers()


@pytest.fixture(scope="session")
def tiny_offline(tiny_llama_dir):
    """The offline engine with the server's options, for reference outputs."""
    from shardserve import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512)
    yield llm
    llm.shutdown()


@pytest.fixture()
def client(tiny_server):
    import openai

    with openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0,
                       timeout=60) as c:
        yield c
