"""Replica recovery: a front end whose engine replica died (its engine-core process, or any worker
under it, on any backend) restarts it and moves the requests it held, so that clients see
neither an error nor a gap (issue: "a server that heals").

    replica i dies ──▶ take_down(i): no longer routed to; its requests handed back
         │                 │
         │                 └─▶ each request, as prompt + the tokens its client already has,
         │                     to a live replica at once, or parked until one is up
         └─▶ stop what is left of it (its workers) ─▶ backoff ─▶ start it again (same index,
             same config) ─▶ routed to; parked requests go to it

Why a moved request continues exactly: the front end holds what its client has seen (prompt,
the tokens produced so far, the detokenizer and stop-string state), and the engine core takes
the request as one preempted after those tokens (input_processor.EngineCoreRequest.
output_token_ids): it recomputes their KV (its prefix cache makes that cheap where it has them),
and everything that depends on the output position goes on from the same place: a seeded row
draws from a generator seeded by (seed, position) (model/sampler.py), the budget is max_tokens
minus the tokens produced, penalties see them, the grammar's matcher replays them. Tokens the
dead replica sampled but never sent are sampled again, identically for greedy and seeded rows.
Usage counts are the front end's, so they are those of an uninterrupted run.

Bounds: at most `max_engine_restarts` restarts within `engine_restart_window_s` (each one after
a backoff that doubles with the restarts already in the window); past it the engine fails as
without recovery. A request whose replica died more than `max_request_migrations` times is
failed (its id logged): a request that kills engines is not retried for ever. A request that
finds no replica up waits at most `engine_restart_timeout_s`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from shardserve.config.recovery import RecoveryConfig
from shardserve.engine.dp_router import NoReplicaUpError
from shardserve.engine.input_processor import EngineCoreRequest
from shardserve.engine.migration_ledger import MigrationLedger
from shardserve.errors import EngineDeadError

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.5, 30.0


class RestartBudget:
    """Restarts within a sliding window, and the backoff before the next one."""

    def __init__(self, max_restarts: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._times: collections.deque[float] = collections.deque()

    def _recent(self) -> int:
        now = self._clock()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return len(self._times)

    def take(self) -> bool:
        """One more restart, if the bound allows it (then it counts)."""
        if self._recent() >= self.max_restarts:
            return False
        self._times.append(self._clock())
        return True

    def backoff_s(self) -> float:
        """0 for the first restart in the window, then 0.5 s doubling up to 30 s."""
        recent = self._recent()
        return 0.0 if recent <= 1 else min(_FIRST_BACKOFF_S * 2 ** (recent - 2), _MAX_BACKOFF_S)

    @property
    def used(self) -> int:
        """Restarts within the window now."""
        return self._recent()

    def describe(self) -> str:
        return f"{self.max_restarts} restarts within {self.window_s:g} s"


def resumed(request: EngineCoreRequest, produced: list[int]) -> EngineCoreRequest:
    """The request to send to another replica: the tokens its client has as output so far. Its
    prompt logprobs came with its first output; they are not computed again."""
    params = request.sampling_params
    if produced and params.prompt_logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=None)
    return dataclasses.replace(request, sampling_params=params,
                               output_token_ids=tuple(produced))


def resumed_open(requests: list[EngineCoreRequest], processor: Any) -> list[EngineCoreRequest]:
    """Those of a request's children still open in the front end's OutputProcessor, each
    resumed from the tokens its client has (both front ends move requests with this)."""
    return [resumed(r, produced) for r in requests
            if (produced := processor.produced(r.request_id)) is not None]


class RecoveryHost(Protocol):
    """What recovery needs of its front end (async_engine.AsyncEngineClient)."""

    replica_set: Any
    metrics: Any
    processor: Any  # its OutputProcessor: what each request's clients have (produced, ...)

    def core_request(self, child_id: str) -> EngineCoreRequest | None: ...

    def fail_request(self, parent_id: str, error: str) -> None: ...

    async def send_add(self, replica: int, request: EngineCoreRequest) -> None: ...

    def mark_dead(self, error: str) -> None: ...


@dataclasses.dataclass
class _Parked:
    """A request moved while no replica was up."""

    parent_id: str
    children: list[EngineCoreRequest]
    deadline: float


class ReplicaRecovery:
    def __init__(self, config: RecoveryConfig, host: RecoveryHost) -> None:
        self.config = config
        self.host = host
        self.budget = RestartBudget(config.restarts, config.engine_restart_window_s)
        self.ledger = MigrationLedger(config.max_request_migrations)  # by parent id
        self._parked: list[_Parked] = []
        self._tasks: set[asyncio.Task] = set()
        self._up = asyncio.Event()  # set while some replica is up
        self._up.set()
        self._gone = asyncio.Event()  # the engine died for good, or is shutting down

    @property
    def enabled(self) -> bool:
        return self.config.restarts > 0

    @property
    def router(self) -> Any:
        return self.host.replica_set.router

    def on_death(self, index: int, cause: str) -> bool:
        """Replica `index` died of `cause`: restart it and move its requests. False when the
        bound does not allow it (the caller fails the engine)."""
        if index in self.router.down or index not in self.router.stats:
            return True  # its other report of the same death (a "dead" message and the exit)
        if index in self.router.draining and self.enabled:
            self._retire_dead(index, cause)  # scaled away already: moved on, not restarted
            return True
        if not self.enabled or not self.budget.take():
            return False
        owned = self.host.replica_set.take_down(index, cause)
        if not self.router.serving:
            self._up.clear()
        logger.error("engine core %d died: %s; restarting it (%d of at most %s) and moving its "
                     "%d requests", index, cause, self.budget.used, self.budget.describe(),
                     len(owned))
        self.host.metrics.on_engine_restart(index)
        self._spawn(self._move(owned, index, cause))
        self._spawn(self._restart(index))
        return True

    def _retire_dead(self, index: int, cause: str) -> None:
        owned = self.host.replica_set.take_down(index, cause)
        logger.error("engine core %d died while it drained (scale-down): %s; moving its %d "
                     "requests", index, cause, len(owned))
        self._spawn(self._move(owned, index, cause))
        self._spawn(self._forget(index))

    async def _forget(self, index: int) -> None:
        rs = self.host.replica_set
        rs.close_input(index)
        await asyncio.to_thread(rs.stop_dead, index)
        rs.forget_dead(index)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        """A recovery task that failed leaves the engine in a state nobody repairs: fail it
        (clearly) rather than stay degraded for ever."""
        self._tasks.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            logger.error("replica recovery failed", exc_info=e)
            self.host.mark_dead(f"replica recovery failed: {type(e).__name__}: {e}")

    # ---- moving requests ----
    def tokens(self, parent: str) -> int | None:
        """Its progress: the tokens its clients have (all children), None once it ended."""
        return self.host.processor.num_tokens(parent)

    def added(self, parent: str) -> None:
        """A new request was sent (a death before its first token charges it)."""
        if self.enabled:
            self.ledger.sent(parent, 0)

    def ended(self, parent: str) -> None:
        was_on_probation = self.ledger.probation == parent
        self.ledger.forget(parent)
        if was_on_probation and self.ledger.suspects:
            self._spawn(self.release_suspects())

    async def _move(self, child_ids: list[str], dead: int, cause: str) -> None:
        processor = self.host.processor
        parents = list(dict.fromkeys(p for cid in child_ids if (p := processor.parent_of(cid))
                                     is not None and processor.produced(cid) is not None))
        give_up, move = self.ledger.on_death(parents, lambda p: self.tokens(p) or 0)
        for parent in give_up:
            self._give_up(parent, dead, cause)
        for parent in move:
            await self._send(self._resumed(parent), dead)
        if self.ledger.suspects:
            logger.warning("requests %s held: they had produced nothing when an engine died "
                           "under them; each goes back alone", list(self.ledger.suspects))
            await self.release_suspects()

    def _resumed(self, parent: str) -> _Parked:
        sent = [r for cid in self.host.processor.child_ids(parent)
                if (r := self.host.core_request(cid)) is not None]
        moved = resumed_open(sent, self.host.processor)
        self.ledger.sent(parent, self.tokens(parent) or 0)
        return _Parked(parent, moved, time.monotonic() + self.config.engine_restart_timeout_s)

    def after_outputs(self) -> None:
        """New tokens arrived, or a request ended: the request on probation may have made
        progress (or be gone), and the next suspect may go."""
        if self.ledger.probation is not None or self.ledger.suspects:
            self._spawn(self.release_suspects())

    async def release_suspects(self) -> None:
        """The next held request, once the one on probation made progress (after outputs)."""
        while (parent := self.ledger.release(self.tokens)) is not None:
            if self.tokens(parent) is not None:
                await self._send(self._resumed(parent), None)
                return
            self.ledger.forget(parent)  # it ended meanwhile (aborted by its client)

    def _give_up(self, parent: str, dead: int, cause: str) -> None:
        error = (f"request {parent} was on an engine replica that died with it "
                 f"{self.config.max_request_migrations + 1} times before it produced a token "
                 f"(the last: engine core {dead}, {cause}); it is not moved again "
                 f"(--max-request-migrations={self.config.max_request_migrations})")
        logger.error("%s", error)
        self.host.metrics.on_requests_failed_after_migration(1)
        self.host.fail_request(parent, error)

    async def _send(self, parked: _Parked, dead: int | None) -> None:
        """To the least loaded live replica, or parked until one is up."""
        if self.tokens(parked.parent_id) is None:
            return  # it ended meanwhile (its client left while it was parked)
        try:
            replica = self.router.assign([r.request_id for r in parked.children])
        except NoReplicaUpError:
            self._parked.append(parked)
            self._spawn(self._expire(parked))
            return
        for request in parked.children:
            await self.host.send_add(replica, request)
        self.host.metrics.on_requests_migrated(1)
        tokens = max((len(r.output_token_ids) for r in parked.children), default=0)
        logger.warning("request %s moved%s to engine core %d after %d tokens", parked.parent_id,
                       "" if dead is None else f" from engine core {dead}", replica, tokens)

    async def _expire(self, parked: _Parked) -> None:
        await asyncio.sleep(max(0.0, parked.deadline - time.monotonic()))
        if parked in self._parked:
            self._parked.remove(parked)
            self.host.fail_request(parked.parent_id, self._no_replica_error())

    def _no_replica_error(self) -> str:
        return (f"no engine replica came up within {self.config.engine_restart_timeout_s:g} s "
                f"(--engine-restart-timeout); replicas {sorted(self.router.down)} restarting")

    async def wait_for_replica(self) -> None:
        """A new request while no replica is up: wait for one, bounded; EngineDeadError past
        the bound."""
        up, gone = asyncio.ensure_future(self._up.wait()), asyncio.ensure_future(self._gone.wait())
        try:
            await asyncio.wait([up, gone], timeout=self.config.engine_restart_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            up.cancel()
            gone.cancel()
        if not self._up.is_set() and not self._gone.is_set():
            raise EngineDeadError(self._no_replica_error())

    def wake_waiters(self) -> None:
        """The engine died or shuts down: requests waiting for a replica stop waiting (and
        find it dead)."""
        self._gone.set()

    # ---- restarting ----
    async def _restart(self, index: int) -> None:
        rs = self.host.replica_set
        start = time.monotonic()
        rs.close_input(index)
        while True:
            await asyncio.to_thread(rs.stop_dead, index)
            await asyncio.sleep(self.budget.backoff_s())
            try:
                await asyncio.to_thread(rs.restart, index, rs.start_timeout_s)
                break
            except Exception as e:  # noqa: BLE001 - logged; retried within the bound
                logger.error("engine core %d failed to restart: %s", index, e)
                if not self.budget.take():
                    self.host.mark_dead(f"engine core {index} failed to restart ({e}) and the "
                                        f"restart bound is reached ({self.budget.describe()})")
                    return
                self.host.metrics.on_engine_restart(index)
        rs.add_restarted(index)
        self._up.set()
        logger.warning("engine core %d restarted in %.2f s", index, time.monotonic() - start)
        parked, self._parked = self._parked, []
        for p in parked:
            await self._send(p, None)
        await self.release_suspects()

    async def stop(self) -> None:
        """Cancel restarts in progress (the front end is shutting down)."""
        self.wake_waiters()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class EngineRestart:
    """The synchronous front end's recovery (LLMEngine, so `LLM`; off unless
    max_engine_restarts > 0): offline there is no one to keep serving meanwhile, so the whole
    client (every replica) is stopped and started again, and each open request is re-added as
    prompt + the tokens it produced, as the asynchronous front end moves them (the same
    MigrationLedger decides which to hold back or give up)."""

    def __init__(self, config: RecoveryConfig) -> None:
        self.config = config
        self.budget = RestartBudget(config.restarts, config.engine_restart_window_s)
        self.ledger = MigrationLedger(config.max_request_migrations)
        self.restarts = 0  # since start

    @property
    def enabled(self) -> bool:
        return self.config.restarts > 0

    def allows(self) -> bool:
        """A restart now, if the bound allows it (then it counts)."""
        return self.enabled and self.budget.take()

    def backoff(self) -> None:
        time.sleep(self.budget.backoff_s())
        self.restarts += 1
