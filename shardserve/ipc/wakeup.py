"""Blocking wake-ups between processes on 32-bit words in shared memory (Linux futex).

Why a futex: a reader that sleeps in ``FUTEX_WAIT`` costs no CPU, and the kernel compares the
word with the value the sleeper last saw *atomically* with queueing it, so a wake-up sent between
"check the flag" and "go to sleep" cannot be lost (the wait returns at once with EAGAIN). The
waker needs no lock and no socket: one ``FUTEX_WAKE`` syscall (a few microseconds) wakes every
process sleeping on the word. We still bound every sleep by the caller (recheck interval), so a
missed or suppressed wake-up costs at most that interval, never a hang.

On platforms without a futex syscall number we fall back to short sleeps (correct, slower).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import time

logger = logging.getLogger(__name__)

# Syscall numbers of futex(2); other architectures use the sleeping fallback.
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT = 0  # not FUTEX_PRIVATE_FLAG: the word is shared between processes
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF
_FALLBACK_SLEEP_S = 0.0002


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> tuple[ctypes._CFuncPtr | None, int]:
    nr = _SYS_FUTEX.get(platform.machine().lower())
    if nr is None or not sys.platform.startswith("linux"):
        return None, -1
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]
    return fn, nr


_syscall, _NR = _load_syscall()
HAVE_FUTEX = _syscall is not None


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``addr`` equals ``expected``, at most ``timeout_s``.

    Returns on wake-up, value mismatch, signal or timeout alike: callers always re-read the
    shared state, so the reason does not matter.
    """
    if timeout_s <= 0:
        return
    if _syscall is None:
        time.sleep(min(timeout_s, _FALLBACK_SLEEP_S))
        return
    sec = int(timeout_s)
    ts = _Timespec(sec, int((timeout_s - sec) * 1e9))
    _syscall(_NR, addr, _FUTEX_WAIT, expected, ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    """Wake every process sleeping on the u32 at ``addr`` (cheap when nobody sleeps)."""
    if _syscall is not None:
        _syscall(_NR, addr, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


DEFAULT_POLL_US = 100.0


def poll_window_s(override_us: float | None) -> float:
    """How long a waiting side polls its word, yielding the core between looks, before it
    sleeps in the kernel.

    Measured on 2 cores with a writer and 2 readers (3 processes; ../shared/bench/
    mq_peer_bench.py): a pure futex sleep costs a wake-up per hop (~95 us a round trip), a
    busy spin steals the core the other side needs, but polling with sched_yield() between looks
    hands the core to whichever process has work, so a round trip took ~21 us. With spare cores
    sched_yield() returns at once and this is a short spin. The window is short, and a side whose
    last wait outlasted several windows (a slow peer) sleeps at once, so an idle queue costs
    nothing.
    """
    return max(0.0, DEFAULT_POLL_US if override_us is None else override_us) * 1e-6


def process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 if unknown); guards against pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22 of stat(5); fields[0] is field 3 (state)
    except (OSError, IndexError, ValueError):
        return 0


def process_alive(pid: int, start_time: int) -> bool:
    """True if ``pid`` runs and is the process that registered (zombies count as dead)."""
    if pid <= 0:
        return True  # never registered: nothing to judge by
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): fall back to signal 0
        return _kill0(pid)
    if fields[0] in (b"Z", b"X"):
        return False
    return start_time == 0 or int(fields[19]) == start_time


def _kill0(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
