"""The Executor contract on the in-process backend: every worker method through collective_rpc."""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np
import pytest

from shardserve.config import KVCacheConfig
from shardserve.engine.config_builder import engine_config_from_kwargs
from shardserve.executor import Executor
from shardserve.executor.uniproc import UniProcExecutor
from shardserve.messages import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    SchedulerOutput,
)
from shardserve.sampling_params import SamplingParams


@pytest.fixture()
def executor(tiny_llama_dir):
    config = engine_config_from_kwargs(str(tiny_llama_dir), dtype="float32", max_model_len=128)
    ex = Executor.get_class(config)(config)
    yield ex
    ex.shutdown()


def _new_request_step(req_id: str, prompt: list[int], params: SamplingParams) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(req_id, prompt, params, [0, 1], 0)],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={req_id: len(prompt)},
        total_num_scheduled_tokens=len(prompt),
    )


def _decode_step(req_id: str, computed: int, finished: set[str] = frozenset()) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData([req_id], [[]], [computed]),
        num_scheduled_tokens={req_id: 1},
        total_num_scheduled_tokens=1,
        finished_req_ids=set(finished),
    )


def test_get_class_maps_backends(tiny_llama_dir):
    config = engine_config_from_kwargs(str(tiny_llama_dir), max_model_len=128)
    assert Executor.get_class(config) is UniProcExecutor
    dotted = engine_config_from_kwargs(
        str(tiny_llama_dir),
        max_model_len=128,
        distributed_executor_backend="shardserve.executor.uniproc.UniProcExecutor",
    )
    assert Executor.get_class(dotted) is UniProcExecutor
    as_class = engine_config_from_kwargs(
        str(tiny_llama_dir), max_model_len=128, distributed_executor_backend=UniProcExecutor
    )
    assert Executor.get_class(as_class) is UniProcExecutor
    # ray and ray_v2: tests/executor/test_ray.py; external_launcher: its own test file.
    bad = engine_config_from_kwargs(
        str(tiny_llama_dir), max_model_len=128, distributed_executor_backend="shardserve.config.X"
    )
    with pytest.raises(AttributeError):
        Executor.get_class(bad)


def test_setup_methods_through_collective_rpc(executor):
    assert executor.collective_rpc("get_rank") == [0]
    assert executor.collective_rpc(lambda w: w.rank * 10 + 1) == [1]
    assert executor.collective_rpc("get_rank", unique_reply_rank=0) == 0
    future = executor.collective_rpc("get_rank", non_block=True)
    assert isinstance(future, Future) and future.result(timeout=1) == [0]
    executor.collective_rpc("init_device")
    executor.collective_rpc("load_model")
    (available,) = executor.determine_available_memory()
    (block_bytes,) = executor.get_kv_cache_block_bytes()
    # 2 layers x (K + V) x 16 tokens x 4 kv heads x head_dim 8 x 4 bytes
    assert block_bytes == 2 * 2 * 16 * 4 * 8 * 4
    assert available > block_bytes
    executor.collective_rpc("initialize_from_config", args=(KVCacheConfig(16, 16),))
    executor.collective_rpc("compile_or_warm_up_model")
    executor.check_health()
    with pytest.raises(AttributeError, match="no public method '_runner'"):
        executor.collective_rpc("_runner")
    err = executor.collective_rpc("sleep", kwargs={"level": 3}, non_block=True)
    with pytest.raises(ValueError, match="level"):
        err.result(timeout=1)


def test_execute_and_sample_through_the_executor(executor):
    executor.initialize_from_config(KVCacheConfig(16, 16))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    prompt = [5, 17, 42, 9]
    assert executor.execute_model(_new_request_step("a", prompt, greedy)) is None
    first = executor.sample_tokens(None)
    assert first.req_ids == ["a"] and first.sampled_token_ids.shape == (1,)
    future = executor.execute_model(_decode_step("a", len(prompt)), non_block=True)
    assert future.result(timeout=5) is None
    second = executor.sample_tokens(None, non_block=True).result(timeout=5)
    assert second.req_ids == ["a"]
    # Constrained decoding hook: only token 7 allowed (bit 7 of the first packed word).
    bitmask = np.zeros((1, (400 + 31) // 32), dtype=np.int32)
    bitmask[0, 0] = 1 << 7
    executor.execute_model(_decode_step("a", len(prompt) + 1))
    forced = executor.sample_tokens(GrammarOutput(["a"], bitmask))
    assert forced.sampled_token_ids.tolist() == [7]
    # Finishing the request frees the worker's state for it; sleep then succeeds.
    executor.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"a"}))
    assert executor.sample_tokens(None).req_ids == []
    executor.sleep(level=2)
    with pytest.raises(RuntimeError, match="no model loaded"):
        executor.check_health()
    executor.wake_up(tags=["weights"])
    executor.wake_up(tags=["kv_cache"])
    executor.check_health()
    executor.execute_model(_new_request_step("b", prompt, greedy))
    assert executor.sample_tokens(None).sampled_token_ids.tolist() == [
        int(first.sampled_token_ids[0])
    ]


def test_shutdown_is_idempotent(executor):
    executor.shutdown()
    executor.shutdown()
    with pytest.raises(RuntimeError):
        executor.collective_rpc("check_health")


def test_failure_callback_runs_before_anyone_sees_the_death(executor):
    """A thread that finds the executor dead can rely on the failure callback having run, even
    while another thread is still inside it (the race CI once hit with ray_v2)."""
    import threading
    import time

    from shardserve import EngineDeadError

    done = []
    executor.register_failure_callback(lambda: (time.sleep(0.3), done.append(1)))
    marker = threading.Thread(target=executor._mark_failed, args=("rank 1 died (test)",))
    marker.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            executor.collective_rpc("get_rank")
        except EngineDeadError as e:
            assert done == [1] and "rank 1 died" in str(e)
            break
    else:
        pytest.fail("the death was never published")
    marker.join(5)
    executor._mark_failed("a second failure")  # recorded once: no second callback, same reason
    assert done == [1]
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        executor.collective_rpc("get_rank")
    late = []
    executor.register_failure_callback(lambda: late.append(1))  # already failed: runs at once
    assert late == [1]


def test_engine_left_for_exit_closes_quietly(tiny_llama_dir, tmp_path):
    """A script that never calls shutdown(): the engine closes at exit, after the thread pools
    stopped (concurrent.futures' exit hook runs before atexit's), with no traceback."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "import shardserve\n"
        f"llm = shardserve.LLM({str(tiny_llama_dir)!r}, dtype='float32', max_model_len=64)\n"
        "out = llm.generate(['hi'], shardserve.SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "print('tokens', len(out[0].outputs[0].token_ids))\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokens 2" in proc.stdout
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, \
        proc.stderr[-2000:]


def test_the_worker_thread_stands_in_forks_way_only_while_it_runs_a_call(executor):
    """The in-process worker thread outlives its engines; between calls it only waits on its
    queue, so an mp engine may still fork its workers then (a Python thread that may hold a
    lock rules fork out: executor/start_method.py). An engine on it, idle, is no obstacle."""
    import threading

    from shardserve.executor import uniproc
    from shardserve.executor.start_method import _why_fork_is_unsafe

    assert "shardserve-worker" not in (_why_fork_is_unsafe() or "")
    release = threading.Event()
    busy = executor.collective_rpc(lambda worker: release.wait(30), non_block=True)
    try:
        assert "shardserve-worker" in (_why_fork_is_unsafe() or "")
    finally:
        release.set()
    assert busy.result(timeout=30) == [True]
    # Its done-callback (the count) runs on the worker thread just after the result is set.
    deadline = time.monotonic() + 10
    while uniproc.worker_thread().pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "shardserve-worker" not in (_why_fork_is_unsafe() or "")
