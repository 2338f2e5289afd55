"""Fixtures for the ipc tests: nothing of ours may be left in /dev/shm (or /tmp) after a test."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from collections.abc import Iterator

import pytest

_CHILD_PIDS: set[int] = set()


def _ours() -> set[str]:
    """Our segments and sockets: names carry the creating pid (this process or its children;
    other engineers' tests create theirs at the same time on this machine)."""
    pids = {str(os.getpid())} | {str(p) for p in _CHILD_PIDS}
    tmp = tempfile.gettempdir()
    found = {f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith("shardserve-mq-")}
    found |= {f"{tmp}/{n}" for n in os.listdir(tmp) if n.startswith("shardserve-mq-")}
    return {f for f in found if os.path.basename(f).split("-")[2] in pids}


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    _CHILD_PIDS.clear()
    yield
    leaked = _ours()
    assert not leaked, f"left behind: {sorted(leaked)}"


@pytest.fixture
def spawn() -> Iterator[mp.context.SpawnContext]:
    """The spawn context; every process started through it is killed and reaped afterwards."""
    ctx = mp.get_context("spawn")
    started: list[mp.process.BaseProcess] = []
    real = ctx.Process

    def process(*args: object, **kwargs: object) -> mp.process.BaseProcess:
        p = real(*args, daemon=True, **kwargs)
        started.append(p)
        return p

    ctx.Process = process  # type: ignore[method-assign]
    try:
        yield ctx
    finally:
        ctx.Process = real  # type: ignore[method-assign]
        for p in started:
            if p.pid is not None:
                _CHILD_PIDS.add(p.pid)
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
