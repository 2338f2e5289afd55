"""The Ray backends on a real (local, CPU-only) Ray: equality with uni, RPC, failures, cleanup.

One Ray instance serves the whole session (conftest.py: ray_cluster; `make test` runs
test_ray_async.py and test_ray_pipeline.py beside this file on it); its files live in a
temporary directory.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

ray = pytest.importorskip("ray")

from fault_helpers import generate_until_dead  # noqa: E402
from lora_cases import LORA_OPTIONS, check_adapter_calls, tiny_adapter, uni_lora_tokens  # noqa: E402
from ray_helpers import nothing_left, our_segments  # noqa: E402

from shardserve import LLM, EngineDeadError, SamplingParams  # noqa: E402

PROMPTS = ["The quick brown fox", "def add(a, b):", "Hello, world! How are", "Tensor parallel"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
# backend, compiled graph
PATHS = {
    "ray-actor-calls": ("ray", False),
    "ray-compiled-graph": ("ray", True),
    "ray_v2": ("ray_v2", None),
}


@pytest.fixture(scope="module")
def uni_tokens(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)
    try:
        return _tokens(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def lora_case(tiny_llama_dir, tmp_path_factory):
    """An adapter and uni's outputs through it."""
    lora = tiny_adapter(tiny_llama_dir, tmp_path_factory.mktemp("ray_lora"))
    return lora, uni_lora_tokens(tiny_llama_dir, lora, PROMPTS, GREEDY)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _llm(path, path_id: str, **kwargs) -> LLM:
    backend, graph = PATHS[path_id]
    options = dict(
        dtype="float32",
        max_model_len=256,
        tensor_parallel_size=2,
        distributed_executor_backend=backend,
        worker_start_timeout_s=90,
    )
    if graph is not None:
        options["ray_use_compiled_graph"] = graph
    options.update(kwargs)
    return LLM(str(path), **options)


@pytest.mark.parametrize("path_id", list(PATHS))
def test_outputs_equal_uni_rpc_and_a_non_output_rank_exception(ray_cluster, tiny_llama_dir,
                                                               uni_tokens, lora_case, path_id):
    """Each path: outputs (also through a LoRA adapter) equal uni's, RPC with its errors; then
    an exception on rank 1 (not the output rank) surfaces fast with its traceback. (One engine
    a path for both, which were a test each: the workers are FaultyWorker, which is Worker
    until a fault is armed.)"""
    before = our_segments()
    llm = _llm(tiny_llama_dir, path_id, worker_cls="faulty_worker.FaultyWorker", **LORA_OPTIONS)
    executor = llm.engine.core.executor
    try:
        assert type(executor).__name__ == {"ray": "RayDistributedExecutor"}.get(
            PATHS[path_id][0], "RayExecutorV2"
        )
        if PATHS[path_id][1] is not None:
            assert executor.use_compiled_graph is PATHS[path_id][1]
        assert llm.collective_rpc("get_rank") == [0, 1]
        assert llm.collective_rpc(lambda w: w.rank * 10) == [0, 10]
        assert executor.collective_rpc("get_rank", unique_reply_rank=1) == 1
        futures = [executor.collective_rpc("get_rank", non_block=True) for _ in range(3)]
        assert all(isinstance(f, Future) for f in futures)
        assert [f.result(timeout=10) for f in reversed(futures)] == [[0, 1]] * 3
        with pytest.raises(ValueError, match=r"rank \d \(pid \d+\).*level") as err:
            executor.collective_rpc("sleep", kwargs={"level": 7})
        assert "Traceback" in str(err.value.__cause__)
        assert llm.collective_rpc("get_rank") == [0, 1]  # healthy after a remote error
        executor.check_health()
        # Ranks share this small machine: one torch thread each.
        assert llm.collective_rpc(lambda w: __import__("torch").get_num_threads()) == [1, 1]
        assert _tokens(llm) == uni_tokens
        if PATHS[path_id][1]:
            assert executor._graph is not None  # the steps really went through the graph
        check_adapter_calls(llm, lora_case[0], PROMPTS, GREEDY, lora_case[1])
        _raises_the_non_output_ranks_exception(llm)
    finally:
        llm.shutdown()
    nothing_left(before)


def _raises_the_non_output_ranks_exception(llm: LLM) -> None:
    llm.collective_rpc("arm_fault", args=([1],))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="injected fault on rank 1") as err:
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    elapsed = time.monotonic() - t0
    print(f"non-output rank exception surfaced after {elapsed * 1000:.0f} ms")
    assert elapsed < 5
    assert "worker rank 1" in str(err.value)
    cause = str(err.value.__cause__)
    assert "Traceback" in cause and "execute_model" in cause


def test_unsatisfiable_placement_group_fails_in_time(ray_cluster, tiny_llama_dir):
    from shardserve.executor.ray.placement import RayPlacementError

    before = our_segments()
    t0 = time.monotonic()
    with pytest.raises(RayPlacementError) as err:
        _llm(tiny_llama_dir, "ray-actor-calls", ray_cpus_per_worker=64, ray_placement_timeout_s=2)
    elapsed = time.monotonic() - t0
    assert elapsed < 10, elapsed
    text = str(err.value)
    print(text)
    assert "{'CPU': 64.0}" in text and "2 bundles" in text
    assert "strategy PACK" in text
    assert "free: {CPU=" in text  # the node's free resources
    nothing_left(before)


@pytest.mark.parametrize("path_id", list(PATHS))
def test_ray_kill_of_a_worker_during_generate(ray_cluster, tiny_llama_dir, path_id):
    before = our_segments()
    llm = _llm(tiny_llama_dir, path_id)
    executor = llm.engine.core.executor
    calls = []
    executor.register_failure_callback(lambda: calls.append(1))
    victim = executor.group.actors[1]
    killed_at = []

    def kill_soon() -> None:
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        ray.kill(victim)

    threading.Thread(target=kill_soon).start()
    try:
        with pytest.raises(EngineDeadError) as err:
            generate_until_dead(llm, PROMPTS * 4, LONG)
        detected = time.monotonic() - killed_at[0]
        print(f"ray.kill detected after {detected * 1000:.0f} ms: {err.value}")
        assert detected < 2
        assert "rank 1" in str(err.value)
        with pytest.raises(EngineDeadError):
            executor.check_health()
        assert calls == [1]
    finally:
        llm.shutdown()
    nothing_left(before)


def test_worker_failing_at_start_up_leaves_nothing(ray_cluster, tiny_llama_dir):
    before = our_segments()
    with pytest.raises(RuntimeError) as err:
        _llm(tiny_llama_dir, "ray_v2", worker_cls="faulty_worker.BrokenWeightsWorker")
    for word in ("rank 1", "FileNotFoundError", "rank1-weights.safetensors"):
        assert word in str(err.value)
    nothing_left(before)


def test_a_named_placement_group_of_the_caller_is_used_and_kept(ray_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    from shardserve.config import ParallelConfig, RayConfig
    from shardserve.executor.ray import placement as ray_placement

    group = placement_group([{"CPU": 1}] * 2, name="callers-group")
    try:
        pc = ParallelConfig(
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            ray=RayConfig(ray_placement_group="callers-group"),
        )
        placement = ray_placement.place_ranks(pc, "cpu")
        assert placement.group.id == group.id and not placement.created_here
        assert placement.bundles == [0, 1] and placement.cpus == [1.0, 1.0]
        ray_placement.remove_placement(placement)  # not ours: kept
        assert ray.util.placement_group_table(group)["state"] == "CREATED"
    finally:
        remove_placement_group(group)


@pytest.mark.parametrize("path_id", list(PATHS))
def test_speculative_decoding_on_every_ray_path(ray_cluster, echo_model, path_id):
    """The output rank's drafts travel back with its output (actor calls, the compiled graph,
    ray_v2's queue), and the verify steps' 1 + d positions out to every rank: the outputs of
    every workload of spec_cases.py equal those without drafts (k = 0) of the same engine, and
    drafts were accepted. The compiled graph runs asynchronously: there every rank fills the
    draft slots of a step planned while the request's previous one ran."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    from spec_cases import NGRAM, run_cases

    llm = _llm(echo_model, path_id, tensor_parallel_size=3, seed=0,
               async_scheduling=path_id == "ray-compiled-graph", speculative_config=NGRAM)
    try:
        reference, none_accepted = run_cases(llm, k=0)
        results, accepted = run_cases(llm, k=3)
        assert none_accepted == 0 and accepted > 0
        assert results == reference
    finally:
        llm.shutdown()


# Context parallelism on every Ray path, the default model against HF: each path once, each
# layout on one path at least, async scheduling on for one and off for the others (mp runs
# every layout: test_context_parallel_mp.py). ray_v2 at TP=3 x DCP=3 was a case of its own:
# the context groups' collectives run inside the workers, the same on every path.
# ray_v2's case is PCP=2 x PP=2: its pipeline on the default model against HF as well (one
# engine where two ran: test_ray_pipeline.py runs ray's PP=2 on the default model).
CONTEXT_PARALLEL = {
    "pcp2": dict(tensor_parallel_size=1, prefill_context_parallel_size=2),
    "pcp2-pp2": dict(tensor_parallel_size=1, prefill_context_parallel_size=2,
                     pipeline_parallel_size=2),
    "tp3-dcp3": dict(tensor_parallel_size=3, decode_context_parallel_size=3),
}


def _handoff_paths(worker) -> tuple[int, int]:
    from shardserve.distributed.parallel_state import get_pp_group

    return get_pp_group().shm_calls, get_pp_group().fallback_calls


@pytest.mark.slow
@pytest.mark.parametrize(("path_id", "layout", "async_on"), [
    ("ray-actor-calls", "tp3-dcp3", False), ("ray-compiled-graph", "pcp2", True),
    ("ray_v2", "pcp2-pp2", False)])
def test_context_parallel_matches_hf(ray_cluster, default_model_path, hf_default_greedy,
                                     path_id, layout, async_on):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
    from pp_oracle import assert_matches_hf

    before = our_segments()
    llm = _llm(default_model_path, path_id, max_model_len=512, async_scheduling=async_on,
               **CONTEXT_PARALLEL[layout])
    try:
        assert_matches_hf(llm, hf_default_greedy)
        if "pp" in layout:  # the stages' hand-off went through shared memory
            assert llm.collective_rpc(_handoff_paths)[0][0] > 0
    finally:
        llm.shutdown()
    nothing_left(before)
