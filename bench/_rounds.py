"""What the benchmarks share: the prompts, interleaved rounds, and per-round ratios.

This VM's speed drifts by 10-50% within minutes, so a ratio between two sides measured minutes
apart compares the drift, not the sides. Every bench therefore keeps all sides up, measures them
back to back within each round (rotating which goes first from round to round), takes each ratio
within a round, and reports the median of the per-round ratios (with their range).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T")

TOPICS = [
    "the ocean",
    "a city at night",
    "machine learning",
    "an old library",
    "mountains",
    "a chess game",
    "the history of bread",
    "volcanoes",
]
STYLES = ["Write a story about", "Explain to a child", "List facts about", "Describe"]


def make_prompts(n: int) -> list[str]:
    return [f"{STYLES[i % len(STYLES)]} {TOPICS[(i // 4) % len(TOPICS)]} (#{i}):" for i in range(n)]


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """`items` starting at position round_index (mod len): each side goes first in turn."""
    if not items:
        return []
    k = round_index % len(items)
    return [*items[k:], *items[:k]]


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn()` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Rounds:
    """Samples keyed by (row, column, ...) tuples or labels, one value per round each."""

    def __init__(self) -> None:
        self._samples: dict[Hashable, list[float]] = defaultdict(list)

    def add(self, key: Hashable, value: float) -> None:
        self._samples[key].append(value)

    def values(self, key: Hashable) -> list[float]:
        return list(self._samples[key])

    def median(self, key: Hashable) -> float:
        values = self._samples[key]
        return statistics.median(values) if values else float("nan")

    def per_round(
        self, fn: Callable[[float, float], float], a: Hashable, b: Hashable
    ) -> list[float]:
        """fn(a, b) for each round in which both were sampled (the same round for both)."""
        return [fn(x, y) for x, y in zip(self._samples[a], self._samples[b], strict=False)]

    def ratios(self, num: Hashable, den: Hashable) -> list[float]:
        """num / den, per round."""
        return self.per_round(lambda x, y: x / y, num, den)

    def ratio(self, num: Hashable, den: Hashable) -> float:
        """The median of the per-round ratios num / den."""
        return median_or_nan(self.ratios(num, den))


def median_or_nan(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float], fmt: str = ".2f") -> str:
    """'lo-hi' of per-round values, for a range column."""
    if not values:
        return "-"
    return f"{min(values):{fmt}}..{max(values):{fmt}}"
