"""Start and stop engine-core processes (core_proc.py), one per data-parallel replica.

Start: every replica is started first, then each one's "ready" is awaited, so N replicas load
their models at the same time. A replica that fails to start stops the others (no process is
left behind) and its error is raised. They start as the mp workers do (start_method.py): forked
where that is safe, so a user's script needs no `if __name__ == "__main__":` guard; else spawned,
refused first, naming the line to guard, when the script would start an engine again on its
re-import.

Liveness: a front end watches each process's sentinel; each process polls the read end of a
"death pipe" whose write end only the front end holds, so EOF there means the front end is gone
and the replica shuts down (stopping its workers) instead of lingering.

Stop: the front end closes the death pipe (and usually sends "shutdown" first), waits
`_JOIN_S` for the process to stop its workers and exit, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from shardserve.config import EngineConfig
from shardserve.engine.core_proc import EngineCoreArgs, run_engine_core
from shardserve.engine.core_wire import EngineAddresses
from shardserve.executor.multinode.secret import with_cluster_secret
from shardserve.executor.start_method import check_spawn_can_import_main, choose_start_method
from shardserve.ipc.segments import unlink_segments_of

logger = logging.getLogger(__name__)

_JOIN_S = 2.5  # an engine process's time to stop its workers and exit before it is killed


class EngineCoreProcess:
    """One engine-core process: started at construction, `wait_ready` before use.

    `method`: "fork" or "spawn" (start_method.py). `inherited`: the parent's ends of the other
    replicas' pipes, which a forked child closes first (their EOF must mean "the front end is
    gone")."""

    def __init__(self, config: EngineConfig, addrs: EngineAddresses, engine_index: int,
                 method: str = "spawn", inherited: tuple[int, ...] = ()) -> None:
        self.engine_index = engine_index
        mp = multiprocessing.get_context(method)
        self._ready_r, ready_w = mp.Pipe(duplex=False)
        death_r, self._death_w = mp.Pipe(duplex=False)
        forked = method == "fork"
        own = (self._ready_r.fileno(), self._death_w.fileno())
        args = EngineCoreArgs(config, addrs, ready_w, death_r, engine_index, forked,
                              close_fds=own + inherited if forked else ())
        name = "shardserve-engine-core" + (f"-{engine_index}" if engine_index else "")
        self.proc = mp.Process(target=run_engine_core, args=(args,), name=name,
                               daemon=False)  # it starts worker processes of its own
        self.proc.start()
        ready_w.close()
        death_r.close()  # only the child may hold the read end: EOF there = we are gone
        self.num_blocks: int | None = None

    def parent_fds(self) -> tuple[int, ...]:
        """Our ends of its pipes that are still open (a forked sibling must close them)."""
        return tuple(c.fileno() for c in (self._ready_r, self._death_w) if not c.closed)

    @property
    def sentinel(self) -> int:
        return self.proc.sentinel

    def describe(self) -> str:
        return f"engine core {self.engine_index} (pid {self.proc.pid})"

    def wait_ready(self, deadline: float, stopped: Callable[[], bool] = lambda: False) -> None:
        """Until the process reports its model loaded; raises its start-up error, or
        TimeoutError past `deadline` (time.monotonic()), or RuntimeError once `stopped()` (the
        front end stops while a replica restarts: it need not wait for the model to load)."""
        try:
            while not self._ready_r.poll(0.1):
                if stopped():
                    raise RuntimeError(f"{self.describe()}: the engine was stopped during its "
                                       f"start")
                if not self.proc.is_alive():
                    raise RuntimeError(f"{self.describe()} exited during start-up "
                                       f"(exit code {self.proc.exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.describe()} did not start in time")
            try:
                status, detail = self._ready_r.recv()
            except EOFError as e:
                raise RuntimeError(f"{self.describe()} exited during start-up") from e
            if status != "ready":
                raise ValueError(f"the engine failed to start: {detail}")
            self.num_blocks = detail
            logger.info("%s ready (%s KV blocks)", self.describe(), detail)
        finally:
            self._ready_r.close()

    def stop(self, told: bool = False) -> None:
        """Wait for the process to exit (it stops its workers), then SIGTERM, then SIGKILL.
        `told`: it was sent "shutdown" and the front end lives on (a scale-down), so it is given
        time to exit before its death pipe closes (an orphaned engine core removes the socket
        folder, which the other replicas still use)."""
        start = time.monotonic()
        if told:
            self.proc.join(_JOIN_S)
        if not self._death_w.closed:
            self._death_w.close()  # EOF on the death pipe: exit even if no "shutdown" arrived
        if not self._ready_r.closed:
            self._ready_r.close()
        self.proc.join(_JOIN_S)
        for stop in (self.proc.terminate, self.proc.kill):
            if not self.proc.is_alive():
                break
            logger.warning("%s did not exit in time; stopping it", self.describe())
            stop()
            self.proc.join(1.0)
        if not self.proc.is_alive():  # killed (SIGKILL, OOM): what it had in /dev/shm is ours
            for name in unlink_segments_of(self.proc.pid):
                logger.info("removed %s, left by %s", name, self.describe())
        logger.info("%s stopped in %.2f s", self.describe(), time.monotonic() - start)


class EngineCoreGroup:
    """The engine-core processes of one front end, by replica index, and the ipc:// addresses
    they use (one input socket each, one output socket for all)."""

    def __init__(self, config: EngineConfig, start_timeout_s: float) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="shardserve-engine-")
        self.output_addr = f"ipc://{self.tmpdir}/out"
        self.procs: dict[int, EngineCoreProcess] = {}
        # A replica may be (re)started from a thread while the front end stops the group: the
        # start's hand-over and the stop are serialised, and a start that ends after the stop
        # stops what it started (nothing is left behind).
        self._lock = threading.Lock()
        self._closed = False
        # A front end that is never shut down must not hang the interpreter's exit:
        # multiprocessing joins non-daemon children at exit, and ours wait for their death
        # pipe. Registered after multiprocessing's own hook, so it runs first.
        self._finalizer = weakref.finalize(self, _stop_and_remove, self.procs, self.tmpdir)
        atexit.register(self._finalizer)
        self._ray: Any = None  # what joining Ray did here (data_parallel_backend="ray")
        self.ray_address: str | None = None
        try:
            if config.parallel_config.multinode.nnodes > 1:  # before the cores start: they share it
                config = with_cluster_secret(config)
            if config.parallel_config.data_parallel_backend == "ray":
                self._join_ray(config)
            self.start(config, range(config.parallel_config.data_parallel_size),
                       start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _join_ray(self, config: EngineConfig) -> None:
        """One Ray cluster for every replica: the configured one, the one this process is in,
        or a local one started here (and stopped with the group); each replica's executor
        joins it by address and creates its own placement group."""
        import ray

        from shardserve.executor.ray.cluster import connect_ray

        self._ray = connect_ray(config.parallel_config)
        self.ray_address = ray.get_runtime_context().gcs_address

    def _replica_config(self, config: EngineConfig, index: int) -> EngineConfig:
        pc = config.parallel_config
        ray = replace(pc.ray, ray_address=self.ray_address or pc.ray.ray_address)
        pc = replace(pc, data_parallel_rank=index, ray=ray)
        return replace(config, parallel_config=pc)

    def input_addr(self, index: int) -> str:
        return f"ipc://{self.tmpdir}/in{index}"

    def start(self, config: EngineConfig, indices: range | list[int],
              timeout_s: float) -> None:
        """Start replicas `indices` together; on a failure the ones started here are stopped
        and the error raised."""
        method = choose_start_method()
        if method == "spawn":
            check_spawn_can_import_main()  # refused here, naming the script line to guard
        new: list[EngineCoreProcess] = []
        try:
            for i in indices:
                inherited = tuple(fd for p in [*self.procs.values(), *new]
                                  for fd in p.parent_fds())
                new.append(EngineCoreProcess(
                    self._replica_config(config, i),
                    EngineAddresses(self.input_addr(i), self.output_addr), i, method, inherited))
            deadline = time.monotonic() + timeout_s
            for proc in new:
                proc.wait_ready(deadline, lambda: self._closed)
            with self._lock:
                if self._closed:
                    raise RuntimeError("the engine was stopped while replicas started")
                self.procs.update({p.engine_index: p for p in new})
        except BaseException:
            _stop_all(new)
            raise

    def stop_one(self, index: int) -> None:
        """Stop one replica that was told to shut down, and forget it."""
        self.procs.pop(index).stop(told=True)

    def sentinels(self) -> dict[int, EngineCoreProcess]:
        return {p.sentinel: p for p in self.procs.values()}

    def stop(self) -> None:
        """Stop every process (in parallel: each has its own deadline), remove the sockets;
        then leave Ray, stopping it if it was started here (after the replicas removed their
        placement groups)."""
        with self._lock:
            self._closed = True
        self._finalizer()
        atexit.unregister(self._finalizer)
        if self._ray is not None:
            from shardserve.executor.ray.cluster import disconnect_ray

            disconnect_ray(self._ray)
            self._ray = None


def _stop_and_remove(procs: dict[int, EngineCoreProcess], tmpdir: str) -> None:
    _stop_all(list(procs.values()))
    procs.clear()
    shutil.rmtree(tmpdir, ignore_errors=True)


def _stop_all(procs: list[EngineCoreProcess]) -> None:
    threads = [threading.Thread(target=p.stop, name=f"stop-{p.engine_index}") for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def describe_exit(proc: EngineCoreProcess) -> str:
    proc.proc.join(timeout=1.0)  # the sentinel turns readable a moment before the exit status
    code = proc.proc.exitcode
    how = f"exit code {code}"
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            how += f", {signal.Signals(-code).name}"
    return f"{proc.describe()} exited unexpectedly ({how})"
