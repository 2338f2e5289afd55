"""Asynchronous scheduling changes nothing a user sees: the same outputs as the synchronous
engine on every workload of async_cases.py, on the uni and mp (TP=3) backends (ray_v2: in
tests/executor/test_ray_async.py), with preemption forced."""

from __future__ import annotations

import pytest
from async_cases import run_cases, stop_points

from shardserve import LLM
from tests.conftest import TP3  # heads that split three ways


@pytest.fixture(scope="module")
def tp3_model(tmp_path_factory, tiny_model_builder):
    return tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("tp3"), **TP3)


def _engine(model, **options) -> LLM:
    options = {"dtype": "float32", "max_model_len": 128, "seed": 0, **options}
    return LLM(str(model), **options)


@pytest.fixture(scope="module")
def sync_results(tp3_model):
    llm = _engine(tp3_model, async_scheduling=False)
    try:
        assert llm.engine.core.max_concurrent_batches == 1
        tokens, stop_text = stop_points(llm)
        return tokens, stop_text, run_cases(llm, tokens, stop_text)
    finally:
        llm.shutdown()


def _check_async_equals_sync(llm: LLM, sync_results) -> None:
    tokens, stop_text, want = sync_results
    assert llm.engine.core.max_concurrent_batches == 2
    got = run_cases(llm, tokens, stop_text)
    for case in want:
        assert got[case] == want[case], case
    # The workloads really stop mid-generation (else the comparison proves little).
    assert any(len(c[0]) < 24 for o in want["stop_token"] for c in o)
    assert any(c[2] == "stop" for o in want["stop_string"] for c in o)
    assert [len(v) for v in want["aborts"].values()] == [20, 3, 20, 3, 20, 3]
    assert all(reason == "stop" and len(t) < 24 for t, reason in want["eos"].values())


def test_uni_async_equals_sync(tp3_model, sync_results):
    llm = _engine(tp3_model)
    try:
        _check_async_equals_sync(llm, sync_results)
    finally:
        llm.shutdown()


def test_uni_async_equals_sync_under_preemption(tp3_model, sync_results):
    # 8 blocks of 16 tokens for 6 requests of up to ~50 tokens: preemption and recompute,
    # with a small token budget splitting prefills into chunks.
    llm = _engine(tp3_model, num_blocks_override=8, max_num_batched_tokens=24)
    try:
        _check_async_equals_sync(llm, sync_results)
        scheduler = llm.engine.core.scheduler
        assert scheduler.total_preemptions > 0
        assert scheduler.kv.num_free_blocks == 8
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_mp_tp3_async_equals_sync(tp3_model, sync_results):
    llm = _engine(tp3_model, tensor_parallel_size=3, distributed_executor_backend="mp")
    try:
        _check_async_equals_sync(llm, sync_results)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_mp_tp3_async_equals_sync_under_preemption(tp3_model, sync_results):
    llm = _engine(tp3_model, tensor_parallel_size=3, distributed_executor_backend="mp",
                  num_blocks_override=8, max_num_batched_tokens=24)  # fmt: skip
    try:
        _check_async_equals_sync(llm, sync_results)
        assert llm.engine.core.scheduler.total_preemptions > 0
        assert llm.engine.core.scheduler.kv.num_free_blocks == 8
    finally:
        llm.shutdown()
