"""Worker process lifecycle for the mp backend: spawn, ready handshake, death watch, shutdown.

    engine process                                  worker process (one per rank)
    ──────────────                                  ─────────────────────────────
    ready pipe (read end)   ◀── READY + reply-queue handle, or FAILED + error
    death pipe (write end)  ──▶ never written; EOF when the engine dies or stops it → worker exits
    monitor thread          ◀── process sentinel becomes ready when the worker exits

Nothing here knows about RPC; executor/multiproc.py composes these pieces.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from shardserve.config import EngineConfig
from shardserve.errors import RemoteError, WorkerStartupError
from shardserve.executor.start_method import check_spawn_can_import_main, choose_start_method
from shardserve.ipc import Handle
from shardserve.worker.worker_main import WorkerProcArgs, worker_main

logger = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    rank: int
    process: BaseProcess
    ready_conn: Connection  # read end
    death_conn: Connection  # write end; closing it tells the worker we are gone
    reply_handle: Handle | None = None
    start_method: str = "spawn"

    @property
    def pid(self) -> int:
        return self.process.pid or -1

    def describe_exit(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"


def start_workers(
    config: EngineConfig,
    broadcast: Handle,
    init_method: str,
    start_method: str | None = None,
    ranks: list[int] | None = None,
    reply_ip: str | None = None,
    into: list[WorkerHandle] | None = None,
    local_ranks: list[int] | None = None,
) -> list[WorkerHandle]:
    """Start one process per rank (fork where safe, else spawn: see start_method.py).

    ranks: this machine's ranks (default: all). reply_ip: the ranks reply over TCP bound there
    (a node other than the engine's), else through shared memory. into: the list each handle
    is appended to as its process starts (returned). local_ranks: each rank's index among all
    the ranks on this machine, every replica's (its CUDA device; default 0, 1, ...)."""
    ranks = list(range(config.parallel_config.world_size)) if ranks is None else ranks
    handles: list[WorkerHandle] = [] if into is None else into
    if not ranks:  # every rank of this engine lives on other nodes
        return handles
    method = start_method or choose_start_method()
    if method == "spawn":
        check_spawn_can_import_main()
    ctx = multiprocessing.get_context(method)
    local_ranks = local_ranks or list(range(len(ranks)))
    for local_rank, rank in zip(local_ranks, ranks, strict=True):
        ready_r, ready_w = ctx.Pipe(duplex=False)
        death_r, death_w = ctx.Pipe(duplex=False)
        # A forked child inherits our ends of its own and the earlier ranks' pipes; holding a
        # death pipe's write end would hide our death (no EOF), so the child closes them first.
        inherited = (ready_r.fileno(), death_w.fileno()) + tuple(
            fd for h in handles for fd in (h.ready_conn.fileno(), h.death_conn.fileno())
        )
        args = WorkerProcArgs(
            config, rank, local_rank, len(ranks), init_method, broadcast, ready_w, death_r,
            close_fds=inherited if method == "fork" else (), forked=method == "fork",
            reply_ip=reply_ip,
        )  # fmt: skip
        proc = ctx.Process(target=worker_main, args=(args,), name=args.label, daemon=True)
        proc.start()
        # Drop our copies of the child's ends, so EOF on either pipe means "the other side is gone".
        ready_w.close()
        death_r.close()
        handle = WorkerHandle(rank, proc, ready_r, death_w, start_method=method)
        # multiprocessing's exit hook SIGTERMs the daemonic children of a process that ends
        # without stopping its workers, then waits for them; a worker leaves that SIGTERM to
        # its live parent (process_setup.py), so the hook's earlier finalizers close its death
        # pipe first: EOF, and it exits.
        multiprocessing.util.Finalize(handle, death_w.close, exitpriority=0)
        handles.append(handle)
    return handles


def wait_for_ready(handles: list[WorkerHandle], timeout_s: float) -> None:
    """Collect every worker's READY (and reply-queue handle); raise on failure or deadline."""
    deadline = time.monotonic() + timeout_s
    pending = {h.ready_conn: h for h in handles}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            ranks = sorted(h.rank for h in pending.values())
            raise WorkerStartupError(
                f"worker ranks {ranks} did not report ready within {timeout_s:.0f} s; raise "
                f"parallel_config.worker_start_timeout_s (LLM(worker_start_timeout_s=...)) if "
                f"loading is just slow"
            )
        sentinels = {h.process.sentinel: h for h in pending.values()}
        for obj in wait(list(pending) + list(sentinels), timeout=remaining):
            handle = pending.get(obj) or sentinels.get(obj)
            if handle is None or handle.ready_conn not in pending:
                continue  # both its pipe and its sentinel fired; handled already
            del pending[handle.ready_conn]
            take_ready_message(handle)


def take_ready_message(handle: WorkerHandle) -> None:
    """Read a worker's READY (keeping its reply handle) or raise WorkerStartupError."""
    # A message sent just before the worker exited is still readable: read before judging.
    message = None
    if handle.ready_conn.poll(0):
        try:
            message = handle.ready_conn.recv()
        except (EOFError, OSError):
            message = None
    if message is not None and message[0] == "READY":
        handle.reply_handle = message[1]
        return
    if message is not None:
        error: RemoteError = message[1]
        raise WorkerStartupError(
            f"worker rank {handle.rank} (pid {handle.pid}) failed during start-up: "
            f"{error.exc_type}: {error.message}\n--- worker traceback ---\n{error.traceback}"
        )
    handle.process.join(timeout=1)
    hint = "; it sent no error report, so any traceback of its own is on stderr above"
    if handle.start_method == "spawn":
        hint += (
            ". A spawned worker first re-imports the main script: an import error there, or an "
            "engine started outside `if __name__ == \"__main__\":`, ends it like this"
        )
    raise WorkerStartupError(
        f"worker rank {handle.rank} (pid {handle.pid}) died during start-up "
        f"({handle.describe_exit()}){hint}"
    )


class WorkerMonitor:
    """Calls `on_death(handle)` once, from its own thread, when the first worker exits."""

    def __init__(self, handles: list[WorkerHandle], on_death: Callable[[WorkerHandle], None]):
        self._handles = handles
        self._on_death = on_death
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self._thread = threading.Thread(
            target=self._run, name="shardserve-worker-monitor", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        sentinels = {h.process.sentinel: h for h in self._handles}
        ready = wait([self._stop_r, *sentinels])
        if self._stop_r in ready:
            return
        dead = sentinels[ready[0]]
        dead.process.join(timeout=1)  # collect the exit code
        self._on_death(dead)

    def stop(self) -> None:
        """Stop watching (before a deliberate shutdown). Safe to call more than once."""
        try:
            self._stop_w.send(None)
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for conn in (self._stop_r, self._stop_w):
            conn.close()


def stop_workers(handles: list[WorkerHandle], grace_s: float) -> None:
    """Staged stop of workers already asked to exit: wait; close their death pipes, SIGTERM,
    wait, SIGKILL."""
    _wait_exit(handles, grace_s)
    # A worker leaves a SIGTERM to us while we live (a process group's: process_setup.py), so
    # the stop comes first by its death pipe: EOF, and it exits (unlinking its segments). A
    # worker blocked inside a C call (a collective, a futex) holding the GIL runs neither its
    # pipe watch nor a signal handler until the call returns, so SIGKILL follows soon.
    for h in handles:
        h.death_conn.close()
    for sig, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
        alive = [h for h in handles if h.process.is_alive()]
        if not alive:
            break
        for h in alive:
            logger.warning(
                "worker rank %d (pid %d) did not exit; sending %s", h.rank, h.pid, sig.name
            )
            try:
                os.kill(h.pid, sig)
            except ProcessLookupError:
                pass
        _wait_exit(alive, wait_s)
    for h in handles:
        h.process.join(timeout=0.1)
        h.death_conn.close()
        h.ready_conn.close()


def _wait_exit(handles: list[WorkerHandle], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    alive = {h.process.sentinel: h for h in handles if h.process.is_alive()}
    while alive and (remaining := deadline - time.monotonic()) > 0:
        for s in wait(list(alive), timeout=remaining):
            # The sentinel closes a moment before the exit status can be collected: join.
            alive.pop(s).process.join(timeout=1)
