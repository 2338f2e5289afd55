"""The start of every child process shardserve makes (engine cores, workers): signals, process
title, logging, and, in a forked child, the thread its work runs on.

Signals: the process that started a child (the front end, for an engine core; the engine core,
for its mp workers) owns the reaction to a stop signal and stops the child itself ("shutdown",
then its death pipe closed). Ctrl-C reaches the whole foreground process group, so children
ignore SIGINT. SIGTERM reaches every process at once when it is sent to the process group
(`kill -TERM -PGID`) or to the cgroup (systemd's default KillMode=control-group); the front end
then drains (the server lets open requests finish), which needs its engine cores and workers.
So a child leaves a SIGTERM to its parent (one log line) while the parent lives and has not
asked it to stop (`stop_requested`: the engine core's death pipe is closed; a worker's parent
closes it before any signal, and the worker then exits by it). Otherwise (the parent is gone,
or its staged stop sends SIGTERM to a child that did not exit) SIGTERM raises
SystemExit(128 + SIGTERM), which unwinds through `finally` blocks. Nothing lingers: a child whose
parent dies sees EOF on its death pipe and exits. A SIGTERM to one child alone, its parent
alive, is thus logged and ignored: stop the front end instead (kill the child to simulate
its crash). Not covered: Ray's actors (the ray and ray_v2 workers) are Ray's processes, with
Ray's SIGTERM handler (they exit), and so is a local Ray instance started here; `ray.init` on
a process's main thread also replaces our handler there. With Ray, a group SIGTERM fails the
open requests: signal the front end alone, or run Ray as a service of its own.
`kill -USR1 <pid>` prints every thread's stack to stderr: who is stuck where.

A forked child inherits the parent's OpenMP state for its main thread only, and that pool's
threads do not exist in the child: the first parallel kernel on the main thread would wait for
them for ever. A new thread builds a pool of its own, so a forked child's work runs on one
(`run_on_fresh_thread`); the main thread keeps the signal handlers (a SIGTERM acted on raises
SystemExit there and ends the process). The start-method policy (executor/start_method.py)
asks `work_thread()` which thread that is, so such a child may fork children of its own.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from shardserve import envs

logger = logging.getLogger(__name__)

_work_thread: threading.Thread | None = None
_parent_pid: int | None = None  # the process that started this one (setup_process)
_stop_requested: Callable[[], bool] | None = None
# The words of the log line of a SIGTERM left to the parent (tests look for them).
LEFT_TO_PARENT = "left to the process that started this one"


def setup_process(title: str, log_format: str,
                  stop_requested: Callable[[], bool] | None = None) -> None:
    """Signals, the process title (`ps`, `top`) and logging of a child process.
    `stop_requested`: whether the parent has asked this process to stop (then a SIGTERM ends
    it even while the parent lives); called from the SIGTERM handler, so quick and safe there."""
    global _parent_pid, _stop_requested
    # The pid multiprocessing recorded at the start: a parent that died before this line
    # already counts as gone (os.getppid() would name whoever adopted us).
    parent = multiprocessing.parent_process()
    _parent_pid = parent.pid if parent is not None else os.getppid()
    _stop_requested = stop_requested
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass
    # force: a forked child inherits the parent's handlers; the child's lines say who wrote them.
    logging.basicConfig(level=envs.log_level(), format=log_format, force=True)


def parent_alive() -> bool:
    """Whether the process that started this one lives (an orphan is adopted by another)."""
    return _parent_pid is not None and os.getppid() == _parent_pid


def _on_sigterm(signum: int, frame: Any) -> None:
    if parent_alive() and not _asked_to_stop():
        # A group's (or cgroup's) SIGTERM: the parent got it too, and stops us when it is done.
        logger.info("signal %d %s (pid %d); pid %d goes on until it stops it", signum,
                    LEFT_TO_PARENT, _parent_pid, os.getpid())
        return
    raise SystemExit(128 + signum)


def _asked_to_stop() -> bool:
    if _stop_requested is None:
        return False
    try:
        return _stop_requested()
    except Exception:  # noqa: BLE001 - a broken check must not keep a process from stopping
        return True


def run_on_fresh_thread(target: Callable[[], None], name: str) -> None:
    """Run `target` on a new thread (see above) and wait for it; its exception is raised here,
    on the main thread, so the process ends with the same exit code and report."""
    global _work_thread
    failure: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            failure.append(e)

    _work_thread = threading.Thread(target=run, name=name, daemon=True)
    _work_thread.start()
    _work_thread.join()
    if failure:
        raise failure[0]


def work_thread() -> threading.Thread:
    """The thread this process's work runs on: the main thread, or run_on_fresh_thread's."""
    return _work_thread if _work_thread is not None else threading.main_thread()
