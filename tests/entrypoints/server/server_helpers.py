"""Helpers of the server tests: a real `shardserve serve` subprocess on 127.0.0.1.

The server binds port 0 and writes the port the OS gave it to a file (`--port-file`): a port
picked by the test and bound later by the server could be taken by anyone in between.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from sync_helpers import wait_until

API_KEY = "test-key"
TINY_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--engine-seed", "0"]
HERE = Path(__file__).resolve().parent
# The designed worst case of a stop is ~5.5 s (uvicorn's 1 s grace, 2.5 s for the engine to exit,
# then SIGTERM and SIGKILL 1 s apart); the rest is room for a loaded 2-core machine. Whether the
# engine stopped on its own (the normal path) is checked in the log, not by the clock.
STOP_LIMIT_S = 20.0


def shm_segments(pids: set[int]) -> set[str]:
    """Our segments created by `pids`: names are shardserve-<kind>-<creator pid>-<random> (other
    engineers' tests create theirs on this machine at the same time)."""
    out = set()
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if parts[0] == "shardserve" and len(parts) > 2 and parts[2].isdigit() \
                and int(parts[2]) in pids:
            out.add(name)
    return out


class Server:
    """`python -m shardserve serve ... --port 0`; ready once it reports its port."""

    def __init__(self, model: Path | None, extra: list[str], log_path: Path,
                 api_key: str | None = API_KEY, start_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        self.api_key = api_key
        port_file = log_path.with_suffix(".port")
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "shardserve", "serve", "--port", "0", "--port-file",
               str(port_file), *extra]
        if model is not None:
            cmd += ["--model", str(model)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait_stopped()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
            env=None if env is None else {**os.environ, **env},
        )
        self.family = {self.proc.pid}  # every process of this server seen so far
        self.socket_dir = ""
        try:
            wait_until(lambda: port_file.exists() or self.proc.poll() is not None,
                       "the server to start", start_timeout_s, interval_s=0.05)
        except AssertionError:
            self.stop()
            raise
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"
        # The file is written after the app's start-up (the engine is connected): no retries.
        assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200, self.log()
        self.family = {self.proc.pid, *(p.pid for p in self.descendants())}
        self.socket_dir = self._socket_dir()

    def _socket_dir(self) -> str:
        """The private directory of the ZMQ ipc:// sockets between server and engine."""
        for conn in psutil.Process(self.proc.pid).net_connections(kind="unix"):
            if conn.laddr and "shardserve-engine-" in conn.laddr:
                return os.path.dirname(conn.laddr)
        raise AssertionError("the server binds no ipc:// socket")

    def leftovers(self) -> list[str]:
        """What this server's processes created and must have removed once it stopped."""
        left = [f"/dev/shm/{n}" for n in shm_segments(self.family)]
        return left + ([self.socket_dir] if self.socket_dir and os.path.exists(self.socket_dir)
                       else [])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def observe(self) -> list[psutil.Process]:
        """The descendants now, added to `family` (a test that kills and restarts processes
        calls it often, so that what short-lived ones leave behind is counted as ours)."""
        now = self.descendants()
        self.family |= {p.pid for p in now}
        return now

    def engine_process(self) -> psutil.Process:
        for p in self.descendants():
            if "engine_core" in " ".join(p.cmdline()):
                return p
        raise AssertionError([p.cmdline() for p in self.descendants()])

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed `name` or `name{labels}` as Prometheus prints it."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                samples[key] = float(value)
        return samples

    def metric(self, key: str, default: float | None = None) -> float:
        value = self.metrics().get(key, default)
        if value is None:
            raise KeyError(key)
        return value

    def send_signal(self, sig: int) -> None:
        self.family |= {p.pid for p in self.descendants()}
        self._signalled_at = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_stopped(self, timeout_s: float = STOP_LIMIT_S) -> float:
        """After send_signal: how long until the server and every process it started were gone.
        Kills stragglers (and fails) past timeout_s."""
        start = self._signalled_at
        try:
            self.proc.wait(max(0.0, start + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        while _alive(self.family) and time.monotonic() - start < timeout_s:
            time.sleep(0.02)
        elapsed = time.monotonic() - start
        left = _alive(self.family)
        for pid in left:
            _kill(pid)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()
        assert not left, f"processes left {elapsed:.1f} s after the signal: {left}\n{self.log()}"
        return elapsed

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_LIMIT_S) -> float:
        """Signal the server; returns how long everything took to go away."""
        self.send_signal(sig)
        return self.wait_stopped(timeout_s)


class StepGate:
    """The test's side of gate_worker.GatedWorker: how many model steps may start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.open()

    @property
    def env(self) -> dict[str, str]:
        """For the server: run GatedWorker (its module is in this folder) behind this gate."""
        paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
        return {"SHARDSERVE_TEST_STEP_GATE": str(self.path),
                "PYTHONPATH": os.pathsep.join(p for p in paths if p)}

    def started(self, rank: int = 0) -> int:
        try:
            return int(Path(f"{self.path}.rank{rank}").read_text())
        except FileNotFoundError:
            return 0

    def _set(self, allowed: float) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(str(allowed))
        os.replace(tmp, self.path)

    def hold(self) -> None:
        """No step may start beyond those already started."""
        self._set(self.started())

    def allow(self, more: int) -> int:
        """`more` steps beyond those started so far; returns the new total."""
        total = self.started() + more
        self._set(total)
        return total

    def open(self) -> None:
        self._set(float("inf"))


def _alive(pids: set[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _die_with_parent() -> None:
    """Runs in the server child before exec: SIGTERM it if pytest dies (even by a crash), so a
    crashed test session cannot leave a server behind."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
