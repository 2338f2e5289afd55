"""Every environment variable shardserve reads: debug and tuning knobs only, `SHARDSERVE_` prefix.

Behaviour that a user configures lives in the typed configs (config.py) and travels to workers as
an argument; nothing here is used to ship configuration between processes. Values are read lazily
(at call time) so tests can set them per process.
"""

from __future__ import annotations

import os


def _get_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from e


def _get_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def log_level() -> str:
    """SHARDSERVE_LOG_LEVEL: logging level of the `shardserve` logger (default INFO)."""
    return os.environ.get("SHARDSERVE_LOG_LEVEL", "INFO").upper()


def num_threads() -> int:
    """SHARDSERVE_NUM_THREADS: torch intra-op threads per worker (0 = torch's default)."""
    return int(_get_float("SHARDSERVE_NUM_THREADS", 0))


def rpc_stall_warning_s() -> float:
    """SHARDSERVE_RPC_STALL_WARNING_S: how often a call that waits on workers logs who it waits for."""
    return _get_float("SHARDSERVE_RPC_STALL_WARNING_S", 60.0)
