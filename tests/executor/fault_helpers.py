"""Shared by the fault tests of every backend."""

from __future__ import annotations

import time

import pytest

from shardserve import LLM, SamplingParams


def generate_until_dead(
    llm: LLM, prompts: list[str], params: SamplingParams, limit_s: float = 60
) -> None:
    """Generate again and again until the engine dies; fail after `limit_s` seconds.

    A single generate can finish before a kill scheduled from another thread lands (the fast
    paths do), which made a one-shot test flaky; the loop makes it wait for the kill instead.
    """
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        llm.generate(prompts, params, use_tqdm=False)
    pytest.fail(f"no EngineDeadError within {limit_s} s of generating")
