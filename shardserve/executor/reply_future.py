"""The reply side of a collective call, for every backend that waits on workers' replies (the
queue RPC of mp and ray_v2, Ray's actor calls and compiled graph).

    Gather:      one call's replies, rank by rank, until every rank it waits for has answered;
                 the wait loop (dead check, deadline, stall warning, poll slices) is here, how
                 a reply is received is the backend's
    ReplyFuture: the Future collective_rpc(non_block=True) returns; result() does the waiting
                 in the caller's thread (no helper thread per call)
    settle:      completes a future from a wait, with the one timeout rule: a TimeoutError
                 before the call's own deadline ends only that wait (the call stays pending and
                 a later result() waits again); after it, the call fails with it
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from shardserve import envs

logger = logging.getLogger(__name__)

POLL_S = 0.1  # longest a waiting caller goes without checking for dead workers

# Receives what came within `slice_s` from the ranks still `missing` into the Gather.
Receive = Callable[[list[int], float], None]


@dataclass
class Gather:
    """One call's replies: `expected` ranks must answer; the value is every rank's, in rank
    order, or `reply_rank`'s alone."""

    method: str
    expected: frozenset[int]
    deadline: float | None  # the call's own (monotonic clock), from collective_rpc's timeout
    reply_rank: int | None
    results: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, method: str | Callable[..., Any], ranks: Iterable[int], timeout: float | None,
           reply_rank: int | None) -> Gather:
        name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
        deadline = None if timeout is None else time.monotonic() + timeout
        return cls(name, frozenset(ranks), deadline, reply_rank)

    def missing(self) -> list[int]:
        return sorted(self.expected - self.results.keys())

    def value(self) -> Any:
        if self.reply_rank is not None:
            return self.results[self.reply_rank]
        return [self.results[r] for r in sorted(self.expected)]

    def wait(self, receive: Receive, wait_deadline: float | None,
             raise_if_dead: Callable[[], None], unusual_workers: Callable[[], str] = lambda: "",
             ) -> Any:
        """Receive until every expected rank has answered; the call's value. Raises
        TimeoutError at the call's deadline or at `wait_deadline` (the caller's wait),
        whichever comes first, naming the ranks that did not answer (and
        `unusual_workers()`'s note); and whatever `raise_if_dead` or `receive` raise."""
        start = time.monotonic()
        next_warning = start + envs.rpc_stall_warning_s()
        while missing := self.missing():
            raise_if_dead()
            deadline = _earliest(self.deadline, wait_deadline)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"{self.method}() got no reply from worker ranks {missing} within "
                    f"{now - start:.1f} s{unusual_workers()} "
                    f"(parallel_config.execute_timeout_s bounds model steps)"
                )
            if now >= next_warning:
                logger.warning(
                    "%s() still waiting on ranks %s after %.0f s", self.method, missing, now - start
                )
                next_warning = now + envs.rpc_stall_warning_s()
            receive(missing, POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - now)))
        return self.value()


class ReplyFuture(Future):
    """A Future whose result() does the waiting in the caller's thread: `wait(future, timeout)`
    completes the future (see `settle`), or raises TimeoutError when only this wait ran out.
    Callers of result() take turns; a future completed meanwhile (by a wait for a later call
    of the same channel) is not waited for again."""

    def __init__(self, wait: Callable[[ReplyFuture, float | None], None]) -> None:
        super().__init__()
        self._wait = wait
        self._lock = threading.Lock()

    @classmethod
    def lazy(cls, fetch: Callable[[float | None], Any], deadline: float | None) -> ReplyFuture:
        """A future completed by its own wait: `fetch(timeout)` returns the value."""
        return cls(lambda future, timeout: settle(future, deadline, lambda: fetch(timeout)))

    def result(self, timeout: float | None = None) -> Any:
        with self._lock:
            if not self.done():
                self._wait(self, timeout)
        return super().result(timeout=0)


def settle(future: Future, deadline: float | None, compute: Callable[[], Any]) -> None:
    """Complete `future` with compute()'s value or exception; a TimeoutError before `deadline`
    is re-raised instead (only that wait ran out; the call is still running). A future that was
    completed meanwhile (failed by a shutdown) keeps that outcome."""
    try:
        value = compute()
    except TimeoutError as e:
        if not passed(deadline):
            raise
        complete(future, error=e)
    except BaseException as e:
        complete(future, error=e)
    else:
        complete(future, value)


def complete(future: Future, value: Any = None, error: BaseException | None = None) -> None:
    """Complete `future` unless something completed it first (whose outcome then stands)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except InvalidStateError:
        pass


def passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)
