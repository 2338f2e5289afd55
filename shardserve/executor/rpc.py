"""The messages of collective_rpc between an executor and its worker processes.

    executor ──RpcRequest──▶ broadcast MessageQueue ──▶ every rank's busy loop
    executor ◀──RpcReply─── one response MessageQueue per rank ◀──┘

Every reply carries the id of the call it answers, so a reply that arrives after its call timed
out or failed is recognised and dropped instead of being returned to a later call.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

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
class RemoteError:
    """An exception raised in a worker, in a form that always unpickles."""

    rank: int
    pid: int
    exc_type: str
    message: str
    traceback: str
    exception: bytes | None  # the pickled exception, when it pickles

    @classmethod
    def capture(cls, rank: int, pid: int, exc: BaseException) -> RemoteError:
        try:
            pickled: bytes | None = cloudpickle.dumps(exc)
        except Exception:
            pickled = None
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank, pid, type(exc).__name__, str(exc), tb, pickled)

    def to_exception(self, method: str) -> BaseException:
        """The worker's exception, re-raisable here: same type where possible, the message
        prefixed with rank and pid, and the remote traceback chained as its cause."""
        text = f"worker rank {self.rank} (pid {self.pid}) raised in {method}(): {self.message}"
        exc: BaseException
        try:
            original = cloudpickle.loads(self.exception) if self.exception else None
            exc = type(original)(text) if original is not None else RuntimeError(text)
        except Exception:
            exc = RuntimeError(f"{self.exc_type}: {text}")
        exc.__cause__ = RemoteTraceback(self.traceback)
        return exc


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; shown as the cause of the re-raised exception."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


@dataclass
class RpcReply:
    call_id: int
    rank: int
    value: Any = None
    error: RemoteError | None = None
