"""The messages of collective_rpc between an executor and its worker processes.

    executor ──RpcRequest──▶ broadcast MessageQueue ──▶ every rank's busy loop
    executor ◀──RpcReply─── one response MessageQueue per rank ◀──┘

Every reply carries the id of the call it answers, so a reply that arrives after its call timed
out or failed is recognised and dropped instead of being returned to a later call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from shardserve.errors import RemoteError

SHUTDOWN = "__shutdown__"  # the method name that ends a worker's busy loop


@dataclass
class RpcRequest:
    call_id: int
    method: str | bytes  # a Worker method name, or a cloudpickled callable(worker, ...)
    args: tuple
    kwargs: dict[str, Any]
    # Only this rank replies on success (None: every rank); a failure always replies.
    reply_rank: int | None = None

    @staticmethod
    def encode_method(method: str | Callable[..., Any]) -> str | bytes:
        return method if isinstance(method, str) else cloudpickle.dumps(method)

    def decode_method(self) -> str | Callable[..., Any]:
        return self.method if isinstance(self.method, str) else cloudpickle.loads(self.method)


@dataclass
class RpcReply:
    call_id: int
    rank: int
    value: Any = None
    error: RemoteError | None = None
