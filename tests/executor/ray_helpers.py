"""Shared by the Ray tests: a Ray instance whose files stay in a temporary directory, and the
check that an engine left nothing behind in it."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import psutil
import ray
from ray.util.placement_group import placement_group_table

from shardserve.executor.ray import cluster
from tests.conftest import our_segments as family_segments

# No token file in ~/.ray, no usage report; RAY_TMPDIR is set to the temporary directory.
_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


# Set once this process has run Ray; conftest.py then ends the process without finalising the
# interpreter (see pytest_unconfigure there).
USED_RAY = False


@contextlib.contextmanager
def ray_env() -> Iterator[str]:
    """Ray's environment variables and a short temporary directory (unix sockets live in it,
    and their paths are limited to ~107 bytes)."""
    global USED_RAY
    USED_RAY = True
    saved = {k: os.environ.get(k) for k in (*_ENV, "RAY_TMPDIR", "PYTHONPATH")}
    tmp = tempfile.mkdtemp(prefix="/tmp/rt")
    os.makedirs(os.path.join(tmp, "ray"))  # RAY_TMPDIR/ray holds the current-cluster address
    os.environ.update(_ENV, RAY_TMPDIR=tmp)  # also where a Ray started by shardserve goes
    # Ray's worker processes inherit this: they can import faulty_worker like mp's do.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved["PYTHONPATH"]) if p)
    try:
        yield tmp
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def ray_session(**init_kwargs) -> Iterator[None]:
    with ray_env() as tmp:
        ray.init(include_dashboard=False, _temp_dir=tmp, **init_kwargs)
        restore_faulthandler()
        raylets = cluster.raylet_pids()
        try:
            yield
        finally:
            ray.shutdown()
            assert_no_ray_processes()
            for pid in raylets:  # what disconnect_ray does for a Ray the executor started
                cluster.remove_raylet_semaphores(pid)


def restore_faulthandler() -> None:
    """ray.init() installs its own fatal-signal handler in this process; put Python's back
    (it chains to Ray's) so a crash in a test prints the Python stack of every thread."""
    faulthandler.enable(all_threads=True)


def ray_children() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "ray" in " ".join(p.cmdline()).lower():
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


# Both waits below end as soon as things are clean; the bounds only turn a leak into a failure
# and leave a loaded 2-core machine time to let Ray's processes exit.
def assert_no_ray_processes(timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ray_children(), [p.cmdline()[:3] for p in ray_children()]


def our_segments() -> set[str]:
    """This process tree's segments (the main part of the suite runs beside the Ray files)."""
    return set(family_segments())


def nothing_left(segments_before: set[str], timeout_s: float = 20.0) -> None:
    """No shardserve actor alive, no placement group left, no new shm segment of ours."""
    deadline = time.monotonic() + timeout_s
    while True:
        actors = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("shardserve_")
        ]
        groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        segments = our_segments() - segments_before
        if not (actors or groups or segments) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not actors, actors
    assert not groups, groups
    assert not segments, segments
