"""The floor prototype for bench/serve.py (--floor-prototype): the least a Python front end can
do to stream completions from shardserve's engine-core process, to measure beside the real server
in the same run.

    python bench/_floor_server.py --port-file F [--dtype auto] [--max-num-seqs 128] ...

What it keeps: the engine-core process and its ZMQ protocol (AsyncEngineClient starts it), the
output processor (incremental detokenization), one server-sent event a token per request, HTTP/1.1
keep-alive with the chunked coding. What it drops, each a cost the real server pays per token or
per request: FastAPI/Starlette/uvicorn (routing, middleware, the ASGI send chain), request
validation, limits and auth, the thread pool for tokenization, a task and an output collector per
request (here the outputs loop writes every event straight to the request's transport), and
full OpenAI chunk bodies (here: choices[0].text, finish_reason, and usage at the end). It serves
only what the bench's light client sends: streamed, greedy completions with ignore_eos.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from itertools import count

from shardserve.engine.async_engine import AsyncEngineClient
from shardserve.engine.config_builder import engine_config_from_kwargs
from shardserve.engine.core_wire import EngineOutputs, EngineRequest
from shardserve.engine.request import Request
from shardserve.sampling_params import SamplingParams

_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
         b"transfer-encoding: chunked\r\n\r\n")


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class _Stream:
    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.sent = 0  # characters of text sent


class FloorServer:
    def __init__(self, client: AsyncEngineClient) -> None:
        self.client = client
        self.streams: dict[str, _Stream] = {}
        self.ids = count()
        client._handle = self.handle  # the outputs loop calls this for every engine message

    def handle(self, msg: EngineOutputs) -> None:
        results, _ = self.client.processor.process(msg.outputs)
        for out in results:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            c = out.outputs[0]
            delta, stream.sent = c.text[stream.sent:], len(c.text)
            event = {"choices": [{"index": 0, "text": delta, "finish_reason": c.finish_reason}]}
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            if out.finished:
                usage = {"choices": [], "usage": {"completion_tokens": len(c.token_ids)}}
                data += b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"
                stream.transport.write(_chunk(data) + b"0\r\n\r\n")
                del self.streams[out.request_id]
            else:
                stream.transport.write(_chunk(data))

    def start(self, transport: asyncio.Transport, body: dict) -> None:
        rid = f"floor-{next(self.ids)}"
        ids = self.client.tokenizer.encode(body["prompt"])
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0, ignore_eos=True)
        self.client.processor.add_request(rid, body["prompt"], ids, {rid: params})
        self.streams[rid] = _Stream(transport)
        transport.write(_HEAD)
        eos = self.client.config.model_config.arch.eos_token_ids
        asyncio.ensure_future(self.client._send(
            EngineRequest("add", request=Request(rid, ids, params, eos_token_ids=eos))))


class _Http(asyncio.Protocol):
    """HTTP/1.1 requests with a Content-Length body, one after another on a connection."""

    def __init__(self, server: FloorServer) -> None:
        self.server, self.buf = server, b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buf = rest[length:]
            self.server.start(self.transport, json.loads(rest[:length]))


async def serve(args: argparse.Namespace) -> None:
    config = engine_config_from_kwargs(args.model, dtype=args.dtype,
                                      max_model_len=args.max_model_len,
                                      max_num_seqs=args.max_num_seqs)
    client = AsyncEngineClient(config)
    await client.start()
    server = FloorServer(client)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: _Http(server), "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, args.port_file)  # the bench reads it once whole
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        listener.close()
        await client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
