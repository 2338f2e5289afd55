"""Removing shared-memory segments whose creator can no longer remove them itself.

Every segment shardserve creates is named ``/dev/shm/shardserve-<kind>-<creator pid>-<random>``
(the MessageQueue's rings: ``mq``; the CPU all-reduce's: ``ar``; pipeline stages' pipes:
``pp``). A process killed by SIGKILL cannot unlink its own, so whoever reaps it (the executor,
after the process is gone) does.
"""

from __future__ import annotations

import os
import re

SHM_DIR = "/dev/shm"


def unlink_segment(name: str | None) -> None:
    """Unlink one segment by its name (with or without a leading '/'); gone already is fine."""
    if not name:
        return
    try:
        os.unlink(os.path.join(SHM_DIR, name.lstrip("/")))
    except FileNotFoundError:
        pass


def unlink_segments_of(pid: int) -> list[str]:
    """Unlink every shardserve segment created by process `pid`, which must be dead (reaped):
    a live process still uses them. Returns the names removed."""
    pattern = re.compile(rf"^shardserve-[a-z]+-{pid}-[0-9a-f]+$")
    try:
        names = [n for n in os.listdir(SHM_DIR) if pattern.match(n)]
    except FileNotFoundError:  # no /dev/shm (not Linux): nothing of ours there either
        return []
    for name in names:
        unlink_segment(name)
    return names
