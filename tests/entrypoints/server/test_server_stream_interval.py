"""--stream-interval N: a streamed request's first token comes at once, then N tokens an event,
the rest at the end; the text is the same as without streaming; a bad N is refused at start-up."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_helpers import TINY_ARGS, Server

from shardserve.entrypoints import cli


def _stream_token_counts(server: Server, body: dict) -> tuple[list[int], str]:
    """Tokens in each streamed event (from its logprobs), and the text joined."""
    counts, text = [], ""
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=server.headers,
                      json={**body, "stream": True, "logprobs": 0}, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                counts.append(len(choice["logprobs"]["tokens"]))
                text += choice["text"]
    return counts, text


def test_events_carry_n_tokens_and_the_text_is_unchanged(tiny_llama_dir, tmp_path):
    server = Server(tiny_llama_dir, [*TINY_ARGS, "--stream-interval", "4",
                                     "--disable-log-stats"],
                    tmp_path / "server.log", env={"SHARDSERVE_LOG_STATS_INTERVAL_S": "0.2"})
    try:
        body = {"prompt": "Hello there", "max_tokens": 18, "temperature": 0,
                "ignore_eos": True}
        counts, text = _stream_token_counts(server, body)
        # [1, 4, 4, 4, 4, 1] when the client keeps up; a client that falls behind gets events
        # merged (one pending output a request), so they hold multiples of 4 and the rest.
        assert counts[0] == 1 and sum(counts) == 18 and len(counts) <= 6, counts
        assert all(n % 4 == 0 for n in counts[1:-1]) and counts[-1] % 4 == 1, counts
        whole = httpx.post(f"{server.url}/v1/completions", headers=server.headers,
                           json=body, timeout=60).json()["choices"][0]["text"]
        assert text == whole
        time.sleep(0.6)  # two stats intervals: --disable-log-stats keeps the log quiet
    finally:
        server.stop()
    assert not server.leftovers()
    assert "Avg generation throughput" not in server.log()


def test_a_bad_stream_interval_is_refused_at_start_up(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--stream-interval", "0"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "--stream-interval" in err and "'0' is not a whole number >= 1" in err, err
