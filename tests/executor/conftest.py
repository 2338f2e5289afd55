"""Executor tests: the exit-status fix for Ray, models shared by the PP tests and the
multi-node tests' environment (the no_leftovers fixture, for fault tests, is in
tests/conftest.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from async_cases import run_cases, stop_points  # noqa: E402

_exit_status = 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A process that ran Ray ends here, after pytest's report, without finalising the
    interpreter: Ray's core worker keeps native threads after ray.shutdown() and CI saw the
    process die of SIGSEGV while exiting after every test had passed (ray-project/ray#31145;
    Ray ends its own workers with os._exit for the same reason, ray-project/ray#18899). Every Ray
    test already checks that it left no process, placement group or segment behind."""
    helpers = sys.modules.get("ray_helpers")
    if helpers is not None and helpers.USED_RAY:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory, tiny_model_builder) -> Path:
    """The tiny random Llama with 4 layers: enough for PP=3 and TP=2 x PP=2."""
    return tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("pp4"),
                              num_hidden_layers=4)  # fmt: skip


@pytest.fixture(scope="module")
def pp_uni_results(four_layer_model):
    """uni's (synchronous) results on every async workload of async_cases.py, on the 4-layer
    model: what every pipeline-parallel engine must reproduce."""
    from shardserve import LLM

    llm = LLM(str(four_layer_model), dtype="float32", max_model_len=128, async_scheduling=False)
    try:
        tokens, stop_text = stop_points(llm)
        return tokens, stop_text, run_cases(llm, tokens, stop_text)
    finally:
        llm.shutdown()


@pytest.fixture()
def cluster_env(monkeypatch) -> dict[str, str]:
    """The multi-node tests' environment (multinode_helpers.cluster_environment): set in this
    process for node 0, and returned for node 1's command."""
    from multinode_helpers import cluster_environment

    return cluster_environment(monkeypatch)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the session, 4 logical CPUs on a 2-core machine (two ranks of 1 CPU
    each fit beside the driver), its files in a temporary directory: test_ray.py,
    test_ray_async.py and test_ray_pipeline.py share it in one interpreter (Makefile), since a
    second ray.init() after ray.shutdown() in one process can crash (ray-project/ray#31145).
    The files whose engines start Ray themselves, or join a cluster of their own, each run in
    an interpreter of their own."""
    from ray_helpers import ray_session

    with ray_session(num_cpus=4):
        yield
