"""Start and stop engine-core processes (core_proc.py), one per data-parallel replica.

Start: every replica is spawned first, then each one's "ready" is awaited, so N replicas load
their models at the same time. A replica that fails to start stops the others (no process is
left behind) and its error is raised.

Liveness: a front end watches each process's sentinel; each process polls the read end of a
"death pipe" whose write end only the front end holds, so EOF there means the front end is gone
and the replica shuts down (stopping its workers) instead of lingering.

Stop: the front end closes the death pipe (and usually sends "shutdown" first), waits
`_JOIN_S` for the process to stop its workers and exit, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import replace
from typing import Any

from shardserve.config import EngineConfig
from shardserve.engine.core_proc import EngineAddresses, run_engine_core
from shardserve.executor.node_link import ensure_cluster_secret

logger = logging.getLogger(__name__)

_JOIN_S = 2.5  # an engine process's time to stop its workers and exit before it is killed


class EngineCoreProcess:
    """One engine-core process: spawned at construction, `wait_ready` before use."""

    def __init__(self, config: EngineConfig, addrs: EngineAddresses, engine_index: int) -> None:
        self.engine_index = engine_index
        mp = multiprocessing.get_context("spawn")
        self._ready_r, ready_w = mp.Pipe(duplex=False)
        death_r, self._death_w = mp.Pipe(duplex=False)
        name = "shardserve-engine-core" + (f"-{engine_index}" if engine_index else "")
        self.proc = mp.Process(target=run_engine_core,
                               args=(config, addrs, ready_w, death_r, engine_index),
                               name=name, daemon=False)  # it starts worker processes of its own
        self.proc.start()
        ready_w.close()
        death_r.close()  # only the child may hold the read end: EOF there = we are gone
        self.num_blocks: int | None = None

    @property
    def sentinel(self) -> int:
        return self.proc.sentinel

    def describe(self) -> str:
        return f"engine core {self.engine_index} (pid {self.proc.pid})"

    def wait_ready(self, deadline: float) -> None:
        """Until the process reports its model loaded; raises its start-up error, or
        TimeoutError past `deadline` (time.monotonic())."""
        try:
            while not self._ready_r.poll(0.1):
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
        logger.info("%s stopped in %.2f s", self.describe(), time.monotonic() - start)


class EngineCoreGroup:
    """The engine-core processes of one front end, by replica index, and the ipc:// addresses
    they use (one input socket each, one output socket for all)."""

    def __init__(self, config: EngineConfig, start_timeout_s: float) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="shardserve-engine-")
        self.output_addr = f"ipc://{self.tmpdir}/out"
        self.procs: dict[int, EngineCoreProcess] = {}
        # A front end that is never shut down must not hang the interpreter's exit:
        # multiprocessing joins non-daemon children at exit, and ours wait for their death
        # pipe. Registered after multiprocessing's own hook, so it runs first.
        self._finalizer = weakref.finalize(self, _stop_and_remove, self.procs, self.tmpdir)
        atexit.register(self._finalizer)
        self._ray: Any = None  # what joining Ray did here (data_parallel_backend="ray")
        self.ray_address: str | None = None
        try:
            if config.parallel_config.nnodes > 1:  # before the cores start: they share it
                ensure_cluster_secret(config)
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

        from shardserve.executor.ray_utils import connect_ray

        self._ray = connect_ray(config.parallel_config)
        self.ray_address = ray.get_runtime_context().gcs_address

    def _replica_config(self, config: EngineConfig, index: int) -> EngineConfig:
        pc = replace(config.parallel_config, data_parallel_rank=index,
                     ray_address=self.ray_address or config.parallel_config.ray_address)
        return replace(config, parallel_config=pc)

    def input_addr(self, index: int) -> str:
        return f"ipc://{self.tmpdir}/in{index}"

    def start(self, config: EngineConfig, indices: range | list[int],
              timeout_s: float) -> None:
        """Start replicas `indices` together; on a failure the ones started here are stopped
        and the error raised."""
        new = []
        try:
            for i in indices:
                new.append(EngineCoreProcess(self._replica_config(config, i),
                                             EngineAddresses(self.input_addr(i),
                                                             self.output_addr), i))
            deadline = time.monotonic() + timeout_s
            for proc in new:
                proc.wait_ready(deadline)
        except BaseException:
            _stop_all(new)
            raise
        self.procs.update({p.engine_index: p for p in new})

    def stop_one(self, index: int) -> None:
        """Stop one replica that was told to shut down, and forget it."""
        self.procs.pop(index).stop(told=True)

    def sentinels(self) -> dict[int, EngineCoreProcess]:
        return {p.sentinel: p for p in self.procs.values()}

    def stop(self) -> None:
        """Stop every process (in parallel: each has its own deadline), remove the sockets;
        then leave Ray, stopping it if it was started here (after the replicas removed their
        placement groups)."""
        self._finalizer()
        atexit.unregister(self._finalizer)
        if self._ray is not None:
            from shardserve.executor.ray_utils import disconnect_ray

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
    return f"{proc.describe()} exited unexpectedly (exit code {proc.proc.exitcode})"
