"""How the engine starts its child processes (the mp backend's workers, the engine cores of
data_parallel_size > 1): fork when it is safe, spawn otherwise.

Fork is what a user's plain script needs: a spawned worker re-imports the script that started
it, so a script without an `if __name__ == "__main__":` guard would start an engine inside every
worker (which fails). Fork copies the parent instead, and is safe only while the parent has no
other Python threads (a lock one of them holds, the logging module's say, stays locked for ever
in the child) and no CUDA context (a forked child cannot use it). Native threads are no obstacle:
torch's own pools and ZMQ's I/O threads are not used by the child, and the parent's OpenMP pool,
which would hang the child's first parallel kernel on its main thread, is avoided by running the
forked child's work on a fresh thread (process_setup.py).
"""

from __future__ import annotations

import ast
import logging
import sys
import threading
from functools import lru_cache

from shardserve import envs
from shardserve.idle_threads import is_idle
from shardserve.process_setup import work_thread

logger = logging.getLogger(__name__)


def choose_start_method() -> str:
    """'fork' or 'spawn' (SHARDSERVE_WORKER_MULTIPROC_METHOD overrides); warns once on spawn."""
    forced = envs.worker_multiproc_method()
    if forced is not None:
        return forced
    reason = _why_fork_is_unsafe()
    if reason is None:
        return "fork"
    logger.warning(
        "starting workers with 'spawn' because %s; each worker re-imports your script, so "
        "code that creates an engine must sit under `if __name__ == \"__main__\":` "
        "(SHARDSERVE_WORKER_MULTIPROC_METHOD=fork|spawn overrides)",
        reason,
    )
    return "spawn"


def _why_fork_is_unsafe() -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "this process holds a CUDA context"
    main = work_thread()  # a forked child's work runs on a fresh thread (process_setup.py)
    if threading.current_thread() is not main:
        return "the engine is being created off the main thread"
    idle = (main, threading.main_thread())  # the latter only waits for the former
    names = sorted(t.name for t in threading.enumerate()
                   if t not in idle and not is_idle(t))
    if names:
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        return f"this process runs {len(names)} other Python thread(s) ({shown})"
    return None


def check_spawn_can_import_main() -> None:
    """Before spawning: fail here, with the fix, if the worker's re-import of the user's script
    would start an engine again (a call at the script's top level, outside the main guard);
    the worker would otherwise die with only an exit code to show for it."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py") or getattr(main, "__spec__", None) is not None:
        return  # interactive, `python -c`, or `python -m` (spawn re-imports modules by name)
    line = _calling_line_in_main()
    if line is not None and not _inside_main_guard(path, line):
        raise RuntimeError(
            f"{path}:{line} starts an engine at the top level of the script, but its workers "
            f"must be started with 'spawn' here, and each spawned worker re-imports the script "
            f"and would run that line again. Put the code under `if __name__ == \"__main__\":`, "
            f"or make fork possible (no threads started before the engine), or set "
            f"SHARDSERVE_WORKER_MULTIPROC_METHOD=fork if you know forking is safe"
        )


def _calling_line_in_main() -> int | None:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return frame.f_lineno
        frame = frame.f_back
    return None


@lru_cache(maxsize=8)
def _main_guard_ranges(path: str) -> tuple[tuple[int, int], ...]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return ((1, 1 << 30),)  # cannot tell: assume guarded
    ranges = []
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            ranges.append((node.lineno, node.end_lineno or node.lineno))
    return tuple(ranges)


def _inside_main_guard(path: str, line: int) -> bool:
    return any(start <= line <= end for start, end in _main_guard_ranges(path))
