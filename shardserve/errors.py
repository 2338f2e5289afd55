"""Errors that cross layers: raised in one layer, caught or re-raised in another.

A leaf module (it imports nothing of shardserve), so the engine, the executors, the workers and
the server can all use these without importing each other.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import cloudpickle


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more requests: a worker died or the executor failed."""


class WorkerStartupError(RuntimeError):
    """A worker process failed or died before reporting ready."""


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


