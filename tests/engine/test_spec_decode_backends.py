"""Speculative decoding with everything else (spec_cases.py's workloads on the echo model):
the same outputs as without speculation, synchronous and asynchronous, under preemption, on mp
with TP=3 and with two pipeline stages, with drafts accepted in every group (structured outputs
included: a constrained request verifies only drafts its grammar accepts, each position under
its own bitmask row). Prefix caching is on throughout (every greedy case shares a prompt with a
sampled one)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from shardserve import LLM

sys.path.insert(0, str(Path(__file__).parent))
from spec_cases import NGRAM, run_cases  # noqa: E402

K = 3


def _engine(model: Path, **options) -> LLM:
    return LLM(str(model), **{"dtype": "float32", "max_model_len": 256, "seed": 0,
                              "speculative_config": NGRAM, **options})


def _shutdown(llm: LLM) -> None:
    """Shut down, and wait for the grammar thread to end: mp starts its workers by fork only
    while this process runs no other thread (else by spawn, seconds slower)."""
    llm.shutdown()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("shardserve-grammar") for t in threading.enumerate()) \
            and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture(scope="module")
def sync_runs(echo_model) -> tuple[dict[str, list[tuple]], tuple, dict[str, int]]:
    """The synchronous engine: without speculation (no drafts verified: the reference), with
    it, and the drafts each group accepts on its own."""
    llm = _engine(echo_model, async_scheduling=False)
    try:
        reference, accepted = run_cases(llm, k=0)
        assert not accepted
        with_spec = run_cases(llm, k=K)
        alone = {name: run_cases(llm, k=K, groups=(name,))[1] for name in reference}
        return reference, with_spec, alone
    finally:
        _shutdown(llm)


@pytest.fixture(scope="module")
def reference(sync_runs) -> dict[str, list[tuple]]:
    return sync_runs[0]


def _check(llm: LLM, reference: dict[str, list[tuple]]) -> None:
    _check_runs(run_cases(llm, k=K), reference)


def _check_runs(runs: tuple[dict[str, list[tuple]], int], reference: dict) -> None:
    results, accepted = runs
    assert results == reference
    assert accepted > 0  # drafts were really verified


def test_sync_identical(sync_runs):
    reference, with_spec, alone = sync_runs
    _check_runs(with_spec, reference)
    assert all(alone.values()), alone  # every group on its own verifies drafts
    for _, text, reason in reference["structured"]:
        assert reason == "stop", text


def test_async_identical(echo_model, reference):
    llm = _engine(echo_model)
    try:
        _check(llm, reference)
    finally:
        _shutdown(llm)


def test_preemption_identical(echo_model, reference):
    """A cache of 8 blocks of 16 tokens for requests of up to ~70: some are preempted (and
    recomputed) while others verify drafts; no draft costs a preemption."""
    llm = _engine(echo_model, num_blocks_override=8, max_model_len=96, max_num_batched_tokens=48)
    try:
        _check(llm, reference)
        assert llm.engine.core.scheduler.total_preemptions > 0
    finally:
        _shutdown(llm)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}],
                         ids=["tp3", "pp2"])
def test_mp_identical(echo_model, reference, layout):
    llm = _engine(echo_model, distributed_executor_backend="mp", **layout)
    try:
        _check(llm, reference)
    finally:
        _shutdown(llm)
