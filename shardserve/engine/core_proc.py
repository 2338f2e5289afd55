"""The engine-core process: EngineCore in a busy loop, fed and drained over ZMQ (the messages
and the socket layout: core_wire.py).

Each loop turn drains every queued EngineRequest, then runs one step while requests are
unfinished (its outputs go out at once), or blocks up to _IDLE_POLL_MS for input; a message
out after anything applied carries fresh figures (e.g. after aborts freed KV blocks).

Liveness, both ways: the front end watches this process's sentinel; this process polls the read
end of a "death pipe" whose write end only the front end holds, so EOF there means the front end
is gone and we shut down (stopping our executor's workers) instead of lingering.

Signals: a SIGTERM sent to every process of the server at once (`kill -TERM -PGID`, systemd)
is left to the front end, which drains and then stops us; one that comes after the front end
closed the death pipe (its staged stop), or after it died, ends us (process_setup.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import zmq

from shardserve.config import EngineConfig
from shardserve.engine.core import EngineCore
from shardserve.engine.core_wire import (
    UTILITY_METHODS,
    EngineAddresses,
    EngineOutputs,
    EngineRequest,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
    decode,
    encode,
    scheduler_stats,
)
from shardserve.process_setup import run_on_fresh_thread, setup_process

logger = logging.getLogger(__name__)

# Longest the idle loop blocks before re-checking the executor and the death pipe.
_IDLE_POLL_MS = 200


@dataclass(frozen=True)
class EngineCoreArgs:
    """What an engine-core process starts with (pickled under spawn)."""

    config: EngineConfig
    addrs: EngineAddresses
    ready: Connection  # write end: "ready" (with the KV block count) or the start-up error
    death: Connection  # read end: EOF once the front end is gone
    engine_index: int = 0
    forked: bool = False
    # Forked: the parent's ends of this and the other replicas' pipes, inherited; closed first
    # (a death pipe's write end held here would hide the front end's death from that replica).
    close_fds: tuple[int, ...] = ()


def run_engine_core(args: EngineCoreArgs) -> None:
    """Process entry point (fork or spawn: core_launcher.py)."""
    for fd in args.close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    suffix = f"_{args.engine_index}" if args.engine_index else ""
    # A SIGTERM is left to the front end while it lives (a group's: it drains first), unless
    # it closed our death pipe: then it is its staged stop (process_setup.py).
    setup_process(f"shardserve::engine_core{suffix}",
                  "%(asctime)s engine-core %(levelname)s %(name)s: %(message)s",
                  stop_requested=args.death.poll)
    if args.forked:
        run_on_fresh_thread(lambda: _serve(args), f"engine-core{suffix}-main")
    else:
        _serve(args)


def _serve(args: EngineCoreArgs) -> None:
    try:
        core = EngineCore(args.config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which exits with it
        args.ready.send(("error", f"{type(e).__name__}: {e}"))
        return
    loop = None
    try:
        args.ready.send(("ready", core.kv_cache_config.num_blocks))
        loop = EngineCoreLoop(core, args.addrs, args.death, args.engine_index)
        loop.run()
    finally:
        core.shutdown()
        if loop is not None and loop.orphaned:  # the front end cannot remove its socket dir now
            shutil.rmtree(os.path.dirname(args.addrs.input_addr.removeprefix("ipc://")),
                          ignore_errors=True)


class EngineCoreLoop:
    def __init__(self, core: Any, addrs: EngineAddresses, death: Connection,
                 engine_index: int = 0) -> None:
        self.core = core
        self.death = death
        self.engine_index = engine_index
        self._pid = os.getpid()  # names this incarnation of the replica (core_wire.py)
        self.requests_added = 0
        self.orphaned = False  # the API server died without telling us
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(addrs.input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(addrs.output_addr)
        # The executor's monitor thread reports a worker's death through this pipe, so an idle
        # loop wakes at once instead of at its next poll (sockets are not thread-safe; pipes are).
        self._wake_r, self._wake_w = os.pipe()
        core.executor.register_failure_callback(self._on_executor_failure)
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self.poller.register(self.death.fileno(), zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)

    def _on_executor_failure(self) -> None:
        os.write(self._wake_w, b"x")

    def run(self) -> None:
        try:
            # The figures known from the start (the KV capacity gauge) before any request.
            self._send(EngineOutputs([], self._stats()))
            self._loop()
        finally:
            self.input.close(linger=0)
            self.output.close(linger=1000)  # let a final "dead" message reach the server
            self.ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _loop(self) -> None:
        while True:
            busy = self.core.has_unfinished_requests()
            events = dict(self.poller.poll(0 if busy else _IDLE_POLL_MS))
            if self.death.fileno() in events:
                logger.info("the front end is gone; shutting down")
                self.orphaned = True
                return
            if self.core.executor.is_failed:
                why = self.core.executor.failure or "a worker died"
                self._report_dead(f"the executor failed: {why}")
                return
            changed, stop = self._drain_input()
            if stop:
                return
            if self.core.has_unfinished_requests():
                if not self._step():
                    return
            elif changed:
                self._send(EngineOutputs([], self._stats()))  # e.g. aborts freed KV blocks

    def _drain_input(self) -> tuple[bool, bool]:
        """Apply every queued message. Returns (anything applied, shutdown requested)."""
        changed = False
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return changed, False
            msg: EngineRequest = decode(frame)
            changed = True
            if msg.kind == "add" and msg.request is not None:
                self.core.add_request(msg.request.to_request())
                self.requests_added += 1
            elif msg.kind == "abort":
                self.core.abort_requests(msg.request_ids)
            elif msg.kind == "utility" and msg.call is not None:
                self._send(EngineOutputs([], self._stats(), utility=self._call(msg.call)))
            elif msg.kind == "shutdown":
                return changed, True

    def _call(self, call: UtilityCall) -> UtilityResult:
        """Run a front end's call on the core; an error goes back to the caller, the engine
        stays up."""
        if call.method not in UTILITY_METHODS:
            return UtilityResult(call.call_id, error=f"ValueError: {call.method!r} is not one of "
                                                     f"{sorted(UTILITY_METHODS)}")
        try:
            if call.method == "collective_rpc":
                return UtilityResult(call.call_id, self.core.executor.collective_rpc(*call.args))
            return UtilityResult(call.call_id, getattr(self.core, call.method)(*call.args))
        except Exception as e:  # noqa: BLE001 - reported to the caller
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}",
                                 bad_input=isinstance(e, ValueError))

    def _step(self) -> bool:
        """Run one step and send its outputs; False once the engine is dead (reported)."""
        try:
            outputs = self.core.step()
        except Exception as e:
            logger.exception("engine step failed; the engine is dead")
            self._report_dead(f"{type(e).__name__}: {e}")
            return False
        self._send(EngineOutputs(outputs, self._stats()))
        return True

    def _stats(self) -> SchedulerStats:
        return scheduler_stats(self.core, self.requests_added)

    def _report_dead(self, error: str) -> None:
        self._send(EngineOutputs([], self._stats(), dead_error=error))

    def _send(self, msg: EngineOutputs) -> None:
        msg.engine_index, msg.pid = self.engine_index, self._pid
        self.output.send(encode(msg), copy=False)
