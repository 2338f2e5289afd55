"""Fault tests leave nothing behind: no worker process, no shared-memory segment of ours."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
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


def our_children() -> list[psutil.Process]:
    """Live child processes, except multiprocessing's resource tracker (one per interpreter)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(
                p.cmdline()
            ):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def our_segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if "shardserve" in n]


@pytest.fixture()
def no_leftovers():
    """Processes and segments the test created are gone at its end (others' may live on, e.g.
    a server another module keeps for the whole session)."""
    before_segments = set(our_segments())
    before_children = {p.pid for p in our_children()}

    def new_children() -> list[psutil.Process]:
        return [p for p in our_children() if p.pid not in before_children]

    yield
    # A hang-catcher, not a speed claim: a clean exit ends the wait at once.
    deadline = time.monotonic() + 30
    while (new_children() or set(our_segments()) - before_segments) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not new_children(), [p.cmdline() for p in new_children()]
    assert not set(our_segments()) - before_segments


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
