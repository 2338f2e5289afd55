"""The start of every child process shardserve makes (engine cores, workers): signals, process
title, logging, and, in a forked child, the thread its work runs on.

Signals: Ctrl-C reaches the whole foreground process group, and the process that started the
child owns the reaction (a staged shutdown), so children ignore SIGINT; SIGTERM (sent to one
process alone) raises SystemExit(128 + SIGTERM), which unwinds through `finally` blocks.
`kill -USR1 <pid>` prints every thread's stack to stderr: who is stuck where.

A forked child inherits the parent's OpenMP state for its main thread only, and that pool's
threads do not exist in the child: the first parallel kernel on the main thread would wait for
them for ever. A new thread builds a pool of its own, so a forked child's work runs on one
(`run_on_fresh_thread`); the main thread keeps the signal handlers (SIGTERM still raises
SystemExit there and ends the process). The start-method policy (executor/start_method.py) asks
`work_thread()` which thread that is, so such a child may fork children of its own.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from shardserve import envs

_work_thread: threading.Thread | None = None


def setup_process(title: str, log_format: str) -> None:
    """Signals, the process title (`ps`, `top`) and logging of a child process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass
    # force: a forked child inherits the parent's handlers; the child's lines say who wrote them.
    logging.basicConfig(level=envs.log_level(), format=log_format, force=True)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


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
