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

import logging
import multiprocessing
import shutil
import tempfile
import threading
import time

from shardserve.config import EngineConfig
from shardserve.engine.core_proc import EngineAddresses, run_engine_core

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

    def stop(self) -> None:
        """Wait for the process to exit (it stops its workers), then SIGTERM, then SIGKILL."""
        if not self._death_w.closed:
            self._death_w.close()  # EOF on the death pipe: exit even if no "shutdown" arrived
        if not self._ready_r.closed:
            self._ready_r.close()
        start = time.monotonic()
        self.proc.join(_JOIN_S)
        for stop in (self.proc.terminate, self.proc.kill):
            if not self.proc.is_alive():
                break
            logger.warning("%s did not exit in time; stopping it", self.describe())
            stop()
            self.proc.join(1.0)
        logger.info("%s stopped in %.2f s", self.describe(), time.monotonic() - start)


class EngineCoreGroup:
    """The engine-core processes of one front end and the ipc:// addresses they use."""

    def __init__(self, config: EngineConfig, start_timeout_s: float) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="shardserve-engine-")
        n = config.parallel_config.data_parallel_size
        self.output_addr = f"ipc://{self.tmpdir}/out"
        self.input_addrs = [f"ipc://{self.tmpdir}/in{i}" for i in range(n)]
        self.procs: list[EngineCoreProcess] = []
        try:
            for i, addr in enumerate(self.input_addrs):
                addrs = EngineAddresses(addr, self.output_addr)
                self.procs.append(EngineCoreProcess(config, addrs, i))
            deadline = time.monotonic() + start_timeout_s
            for proc in self.procs:
                proc.wait_ready(deadline)
        except BaseException:
            self.stop()
            raise

    def sentinels(self) -> dict[int, EngineCoreProcess]:
        return {p.sentinel: p for p in self.procs}

    def exited(self) -> list[EngineCoreProcess]:
        return [p for p in self.procs if not p.proc.is_alive()]

    def stop(self) -> None:
        """Stop every process (in parallel: each has its own deadline), remove the sockets."""
        threads = [threading.Thread(target=p.stop, name=f"stop-{p.engine_index}")
                   for p in self.procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def describe_exit(proc: EngineCoreProcess) -> str:
    proc.proc.join(timeout=1.0)  # the sentinel turns readable a moment before the exit status
    return f"{proc.describe()} exited unexpectedly (exit code {proc.proc.exitcode})"
