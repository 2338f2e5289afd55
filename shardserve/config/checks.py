"""The one validation helper every config uses."""

from __future__ import annotations


def check(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok: messages name the bad value and how to fix it."""
    if not ok:
        raise ValueError(message)
