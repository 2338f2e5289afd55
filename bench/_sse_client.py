"""The server bench's light client: streaming completions over raw asyncio sockets.

Why not httpx: on this 2-core machine the load generator shares the cores with the server it
measures, and every CPU-second it spends is taken from the engine's kernels (a preempted OpenMP
thread stalls the whole step at its next barrier). httpx cost ~0.11 cores at 32 streams; this
client does only what the measurement needs: one keep-alive HTTP/1.1 connection per client, the
chunked transfer coding, and a JSON parse of each server-sent event. The bench reports the CPU it
used either way.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Result:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: bool = True


class Connection:
    """One keep-alive connection; requests on it run one after another."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> Connection:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer, parts.netloc)

    def close(self) -> None:
        self.writer.close()

    async def stream_completion(self, prompt: str, max_tokens: int) -> Result:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        t0 = time.perf_counter()
        self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                          % (self.host.encode(), len(body), body))
        status, headers = await self._read_head()
        result = Result()
        if status != 200 or headers.get("transfer-encoding") != "chunked":
            await self.reader.readexactly(int(headers.get("content-length", 0)))
            result.ok = False
            return result
        last = None
        async for event in self._events():
            now = time.perf_counter()
            if event.get("usage"):
                result.tokens = event["usage"]["completion_tokens"]
            if not event.get("choices"):
                continue
            if last is None:
                result.ttft = now - t0
            else:
                result.gaps.append(now - last)
            last = now
        result.ok = result.tokens == max_tokens
        return result

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _events(self):
        """Each `data: {...}` event of the chunked body, parsed, until the body's last chunk."""
        buf = b""
        while True:
            size = int((await self.reader.readline()).split(b";")[0], 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                return
            buf += data[:-2]
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {"):
                    yield json.loads(event[6:])
