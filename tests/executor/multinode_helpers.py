"""Multi-node on loopback, shared by test_multinode.py, test_multinode_secret.py and
test_multinode_recovery.py: node 0 is the test process (LLM with nnodes=2) or a script of its
own, node 1 is `shardserve serve --headless` in a process tree of its own."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from shardserve import LLM

SECRET = "multinode-test-secret"


def cluster_environment(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The secret, one torch thread a process (two "machines" share 2 cores), a wider silence
    bound, and this folder on node 1's path: its workers unpickle the functions of these
    modules that collective_rpc sends (by reference). Returns the environment for node 1's
    command."""
    monkeypatch.setenv("SHARDSERVE_CLUSTER_SECRET", SECRET)
    monkeypatch.setenv("SHARDSERVE_NUM_THREADS", "1")
    # A "node" shares 2 cores with the rest of the suite: once, at the suite's busiest start, a
    # ready agent's heartbeats went unheard for 2.5 s and node 0 declared it dead. A node that
    # dies is seen by its closed connection, at once, whatever this bound.
    monkeypatch.setenv("SHARDSERVE_NODE_SILENT_S", "10")
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get(
        "PYTHONPATH")])))
    return {**os.environ}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid(worker) -> int:
    return os.getpid()


class Headless:
    """`shardserve serve --headless` as node 1, in a session of its own (killable as a tree)."""

    def __init__(self, port: int, model: str | None, *flags: str, env: dict[str, str]) -> None:
        argv = [sys.executable, "-m", "shardserve", "serve", *([model] if model else []),
                "--headless", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port),
                "--dtype", "float32", *flags]
        self.proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.pids: set[int] = {self.proc.pid}

    def tree(self) -> set[int]:
        try:
            self.pids |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        return self.pids

    def kill_tree(self) -> None:
        self.tree()
        os.killpg(self.proc.pid, signal.SIGKILL)

    def alive(self) -> list[int]:
        alive = []
        for pid in self.pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def wait_for_line(self, text: str, timeout: float = 60) -> None:
        if text not in line_with(self.proc, text, timeout):
            raise AssertionError(f"node 1 never said {text!r}")

    def finish(self, timeout: float = 30) -> tuple[int | None, str]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            out, _ = self.proc.communicate()
        return self.proc.returncode, out


def line_with(proc: subprocess.Popen, text: str, timeout: float) -> str:
    """Read `proc`'s output until a line holds `text` (bounded: a hang-catcher); "" if none
    did before the deadline or the end. Reads the pipe's descriptor itself: a text-mode
    readline() after select() can pull the next line into Python's buffer, where select() no
    longer sees it (a secret printed as the second line of one write was missed that way)."""
    assert proc.stdout is not None
    fd, rest = proc.stdout.fileno(), getattr(proc, "unread", b"")
    deadline = time.monotonic() + timeout
    while True:
        while b"\n" in rest:
            line, rest = rest.split(b"\n", 1)
            if text.encode() in line:
                proc.unread = rest  # type: ignore[attr-defined]
                return line.decode(errors="replace") + "\n"
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if select.select([fd], [], [], min(0.5, left))[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            rest += chunk
    proc.unread = rest  # type: ignore[attr-defined]
    return ""


def node_0_script(text: str, tmp_path: Path, model: Path, port: int,
                  env: dict[str, str]) -> subprocess.Popen:
    """Node 0 as a script of its own (`text`: argv model, port), in a session of its own."""
    script = tmp_path / "node0.py"
    script.write_text(text)
    return subprocess.Popen([sys.executable, str(script), str(model), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def gone_within(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not check():
            return True
        time.sleep(0.05)
    return not check()


@contextlib.contextmanager
def two_nodes(model: Path | None, env: dict[str, str], headless_flags: list[str],
              **llm_kwargs: Any) -> Iterator[tuple[LLM, Headless]]:
    """Node 1 (`--headless` with `headless_flags`) and node 0 (this process's LLM). On a clean
    exit node 1 must have stopped by node 0's request (status 0); otherwise it is killed."""
    port = free_port()
    node1 = Headless(port, str(model) if model else None, *headless_flags, env=env)
    try:
        llm = LLM(str(model) if model else None, dtype="float32", nnodes=2, master_port=port,
                  **llm_kwargs)
        try:
            yield llm, node1
        finally:
            llm.shutdown()
        code, out = node1.finish()
        assert code == 0, out
    finally:
        if node1.proc.poll() is None:
            node1.kill_tree()
            node1.finish()
