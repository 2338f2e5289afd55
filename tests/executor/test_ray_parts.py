"""The Ray package's parts without a cluster (actor names and environment, bundles, the
compiled-graph choice, detach), and an engine that starts (and stops) its own Ray, leaving none
of its raylet's semaphores behind."""

from __future__ import annotations

import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray_helpers import assert_no_ray_processes, our_segments, ray_env  # noqa: E402

from shardserve import LLM, SamplingParams  # noqa: E402
from shardserve.config import ParallelConfig, RayConfig  # noqa: E402
from shardserve.executor.ray.compiled_graph import detach, use_compiled_graph  # noqa: E402
from shardserve.executor.ray.placement import bundle_specs  # noqa: E402
from shardserve.executor.ray.worker_group import actor_name, worker_env  # noqa: E402
from shardserve.messages import ModelRunnerOutput  # noqa: E402


def test_actor_names_are_predictable():
    pc = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert actor_name("ab12", 1, pc) == "shardserve_ab12_TP1"


def test_worker_env_propagates_knobs_not_per_worker_vars(monkeypatch):
    monkeypatch.setenv("SHARDSERVE_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("SHARDSERVE_HOST_IP", "10.0.0.1")
    env = worker_env(threads=3)
    assert env["SHARDSERVE_LOG_LEVEL"] == "DEBUG" and env["HF_HUB_OFFLINE"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env and "SHARDSERVE_HOST_IP" not in env
    assert env["OMP_NUM_THREADS"] == "3"


def test_bundles_and_config_validation():
    pc = ParallelConfig(
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        ray=RayConfig(ray_cpus_per_worker=0.5,
                      ray_bundle_resources='{"slot": 1}'),  # as given on the command line
    )
    assert bundle_specs(pc, "cpu") == [{"CPU": 0.5, "slot": 1}] * 2
    assert bundle_specs(pc, "cuda")[0]["GPU"] == 1.0
    with pytest.raises(ValueError, match="ray_placement_strategy"):
        RayConfig(ray_placement_strategy="CLOSE")
    with pytest.raises(ValueError, match="ray_bundle_resources"):
        RayConfig(ray_bundle_resources={"slot": "one"})


def test_compiled_graph_default_depends_on_cores():
    cores = len(os.sched_getaffinity(0))
    assert use_compiled_graph(None, cores) is False  # as many workers as cores: actor calls
    assert use_compiled_graph(None, cores - 1) is (cores > 1)
    assert use_compiled_graph(True, 64) is True


def test_detach_copies_read_only_arrays():
    ids = np.arange(3)
    ids.flags.writeable = False
    out = detach(ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=ids))
    assert out.sampled_token_ids.flags.writeable and out.sampled_token_ids.tolist() == [0, 1, 2]
    writable = ModelRunnerOutput.empty()
    assert detach(writable) is writable


def _ray_semaphores() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("sem.obj", "sem.hdr"))}


def _leaked(names: set[str]) -> set[str]:
    """Those of `names` whose raylet (the pid in sem.hdr<pid>-...) has exited: a Ray another
    test file runs beside this one (make test runs two at once) keeps its own while it lives."""
    return {n for n in names if not os.path.exists(f"/proc/{n[7:].split('-')[0]}")}


def test_engine_starts_and_stops_its_own_ray(tiny_llama_dir):
    """No Ray initialised and no address: the executor starts a local Ray, and stops it. Its
    stages on the compiled graph (PP=2): Ray's raylet leaves the semaphores of actor-to-actor
    graph channels in /dev/shm; the executor removes those of a raylet it started, once that
    raylet has exited. (This and test_ray_pipeline.py's semaphore check on a Ray of its own
    were a test each, on ray_v2 and on the graph: both backends connect through the same
    RayWorkerGroup, executor/ray/cluster.py.)"""
    assert not ray.is_initialized()
    before, semaphores = our_segments(), _ray_semaphores()
    with ray_env():
        os.environ.pop("RAY_ADDRESS", None)
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128,
                  pipeline_parallel_size=2, distributed_executor_backend="ray",
                  ray_use_compiled_graph=True, worker_start_timeout_s=90)
        try:
            assert llm.engine.core.executor.group.connection.started_local
            params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
            assert len(llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 3
            assert _ray_semaphores() - semaphores  # the graph's channels made some
        finally:
            llm.shutdown()
        assert not ray.is_initialized()
        assert_no_ray_processes()
    assert our_segments() == before
    assert not _leaked(_ray_semaphores() - semaphores)
