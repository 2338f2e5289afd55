"""One bounded wait of a MessageQueue side: deadline, periodic warnings, liveness checks.

Every blocking loop in the queue sleeps in slices of at most the recheck interval and calls
``tick()`` between slices, so a wait always ends by timeout, close, or the peer's death, and a
long one says, once per warning interval, whom it is waiting for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("shardserve.ipc.message_queue")

_LIVENESS_S = 0.25  # how often a blocked side checks that its peer process still exists


class BoundedWait:
    """Book-keeping of one blocked wait: deadline, periodic warnings and liveness checks."""

    __slots__ = ("mq", "start", "deadline", "next_warn", "next_live", "describe", "liveness")

    def __init__(self, mq: Any, deadline: float | None,
                 describe: Callable[[], str], liveness: Callable[[], None]) -> None:
        self.mq, self.deadline, self.describe, self.liveness = mq, deadline, describe, liveness
        self.start = time.monotonic()
        self.next_warn = self.start + mq.warn_interval_s
        self.next_live = self.start + _LIVENESS_S

    def tick(self) -> float:
        """Raise if the wait must end; else return how long to sleep before rechecking."""
        self.mq._raise_if_closing()
        now = time.monotonic()
        if now >= self.next_live:
            self.next_live = now + _LIVENESS_S
            self.liveness()
        if self.deadline is not None and now >= self.deadline:
            raise TimeoutError(f"{self.mq._who()}: timed out after {now - self.start:.2f} s: "
                               f"{self.describe()}")
        if now >= self.next_warn:
            self.next_warn = now + self.mq.warn_interval_s
            logger.warning("%s: still waiting after %.0f s: %s", self.mq._who(),
                           now - self.start, self.describe())
        nearest = min(self.next_warn, self.next_live)
        if self.deadline is not None:
            nearest = min(nearest, self.deadline)
        return max(0.0, min(self.mq.recheck_s, nearest - now))
