"""Helpers of the server tests: a real `shardserve serve` subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

API_KEY = "test-key"
TINY_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--engine-seed", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "shardserve" in n}


class Server:
    """`python -m shardserve serve ...` on a free loopback port; waits for /health."""

    def __init__(self, model: Path | None, extra: list[str], log_path: Path,
                 api_key: str | None = API_KEY, start_timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "shardserve", "serve", "--port", str(self.port), *extra]
        if model is not None:
            cmd += ["--model", str(model)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.shm_before = shm_segments()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        self._wait_healthy(start_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy within {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 5.0) -> float:
        """Signal the server; returns how long everything took to go away. Kills stragglers
        (and fails) if it took longer than timeout_s."""
        family = [self.proc.pid, *(p.pid for p in self.descendants())]
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        while _alive(family) and time.monotonic() - start < timeout_s:
            time.sleep(0.05)
        elapsed = time.monotonic() - start
        left = _alive(family)
        for pid in left:
            _kill(pid)
        if self.proc.poll() is None:
            self.proc.wait(5)
        self._log.close()
        assert not left, f"processes left {elapsed:.1f} s after signal {sig}: {left}"
        return elapsed


def _alive(pids: list[int]) -> list[int]:
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
