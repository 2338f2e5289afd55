"""RecoveryConfig: what a front end does when one of its engine replicas dies (a worker or the
engine-core process): restart it and move its requests (engine/replica_recovery.py), within a
bound, or fail as before."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.config.checks import check as _check

# The server's default when --max-engine-restarts is not given (LLM / AsyncLLM: 0, off).
SERVER_MAX_ENGINE_RESTARTS = 5


@dataclass(frozen=True)
class RecoveryConfig:
    max_engine_restarts: int | None = None
    """Restart a dead engine replica (engine core or any of its workers) at most this many times
    within --engine-restart-window; its requests continue on a live replica or the restarted
    one. 0: a death fails the engine (every open request gets the error). Default: 5 for
    `shardserve serve`, 0 (off) for LLM and AsyncLLM."""
    engine_restart_window_s: float = 600.0
    """The window (seconds) over which --max-engine-restarts is counted."""
    max_request_migrations: int = 2
    """A request whose replica died more than this many times is failed (with its id logged)
    instead of moved again: a request that kills engines is not retried for ever."""
    engine_restart_timeout_s: float = 120.0
    """How long a request waits for a replica while none is up (all restarting) before it is
    failed (a replica's restart itself is bounded as its first start was)."""

    def __post_init__(self) -> None:
        m = self.max_engine_restarts
        _check(m is None or (isinstance(m, int) and m >= 0),
               f"max_engine_restarts={m!r} must be an int >= 0 (0 turns restarts off)")
        _check(self.engine_restart_window_s > 0,
               f"engine_restart_window_s={self.engine_restart_window_s!r} must be > 0")
        _check(isinstance(self.max_request_migrations, int) and self.max_request_migrations >= 0,
               f"max_request_migrations={self.max_request_migrations!r} must be an int >= 0")
        _check(self.engine_restart_timeout_s > 0,
               f"engine_restart_timeout_s={self.engine_restart_timeout_s!r} must be > 0")

    @property
    def restarts(self) -> int:
        """The bound in force (None: the front end's default, here off)."""
        return self.max_engine_restarts or 0
