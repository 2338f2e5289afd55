"""Fault tests leave nothing behind: no worker process, no shared-memory segment of ours."""

from __future__ import annotations

import os
import time

import psutil
import pytest


def our_children() -> list[psutil.Process]:
    """Live child processes, except multiprocessing's resource tracker (one per interpreter)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(
                p.cmdline()
            ):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def our_segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if "shardserve" in n]


@pytest.fixture()
def no_leftovers():
    before = set(our_segments())
    yield
    deadline = time.monotonic() + 5
    while (our_children() or set(our_segments()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not our_children(), [p.cmdline() for p in our_children()]
    assert not set(our_segments()) - before
