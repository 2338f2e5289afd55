"""Engine-core clients with data parallelism: `data_parallel_size=2` engine cores, each in its
own process with its own executor, behind one LLM. Greedy outputs equal HF transformers';
requests spread over the replicas while one request's children stay together; aborts reach
the owner; utility calls reach every replica; a replica that dies fails the engine fast, naming
it, with nothing left behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from shardserve import LLM, EngineDeadError, SamplingParams
from shardserve.engine.inproc_client import InprocClient
from shardserve.engine.mp_client import MPClient

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
from pp_oracle import assert_matches_hf  # noqa: E402

from tests.sync_helpers import wait_until  # noqa: E402


def worker_threads(worker) -> int:
    """collective_rpc target (module level: the engine processes import it by name)."""
    return torch.get_num_threads()


def default_threads(worker) -> int:
    """What torch picks in that process when nothing set it (the worker kept it)."""
    return worker._default_threads


@pytest.fixture(scope="module")
def dp_llm():
    llm = LLM(dtype="float32", max_model_len=512, data_parallel_size=2)
    yield llm
    llm.shutdown()


def added(llm: LLM) -> list[int]:
    llm.engine.client.call("is_sleeping")  # a round trip: every replica's figures are fresh
    return [s.requests_added for s in llm.engine.client.stats()]


def test_inproc_by_default_mp_with_replicas(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), max_model_len=128)
    try:
        assert isinstance(llm.engine.client, InprocClient)
    finally:
        llm.shutdown()


def test_dp2_greedy_matches_hf_and_uses_both_replicas(dp_llm, hf_default_greedy) -> None:
    assert isinstance(dp_llm.engine.client, MPClient)
    before = added(dp_llm)
    assert_matches_hf(dp_llm, hf_default_greedy)
    delta = [a - b for a, b in zip(added(dp_llm), before, strict=True)]
    assert sum(delta) == 8 and min(delta) >= 2, delta


def test_children_of_one_request_share_a_replica(dp_llm) -> None:
    before = added(dp_llm)
    params = SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=3)
    out = dp_llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    delta = sorted(a - b for a, b in zip(added(dp_llm), before, strict=True))
    assert delta == [0, 4]


def test_abort_reaches_the_owner(dp_llm) -> None:
    engine = dp_llm.engine
    engine.add_request("long", "Tell me a story.", SamplingParams(max_tokens=400,
                                                                  ignore_eos=True))
    engine.add_request("short", "Hi", SamplingParams(max_tokens=3, ignore_eos=True))
    owners = dict(engine.client.router.owner)
    assert owners["long"] != owners["short"]  # the second went to the idle replica
    finished: dict[str, str | None] = {}
    while "short" not in finished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    aborted = engine.abort_request("long")
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort"]
    assert not engine.has_unfinished_requests()

    def idle() -> bool:  # the owner frees it once its step in flight has resolved
        engine.client.call("is_sleeping")
        return all(s.num_running == s.num_waiting == 0 and s.kv_cache_usage == 0
                   for s in engine.client.stats())

    wait_until(idle, "the owner to free the aborted request")


def test_utility_calls_reach_every_replica(dp_llm) -> None:
    # Two replicas of one rank each split the machine's cores.
    want = max(1, len(os.sched_getaffinity(0)) // 2)
    assert dp_llm.collective_rpc(worker_threads) == [want, want]
    dp_llm.sleep(1)
    assert dp_llm.engine.client.call("is_sleeping") == [True, True]
    dp_llm.wake_up()
    assert dp_llm.engine.client.call("is_sleeping") == [False, False]
    out = dp_llm.generate("The capital of France is", SamplingParams(max_tokens=4,
                                                                     temperature=0))
    assert out[0].outputs[0].text
    with pytest.raises(ValueError, match="engine core 0: sleep"):  # a bad value: ValueError
        dp_llm.engine.client.call("sleep", 3)  # a bad level: refused, the engine stays up
    with pytest.raises(ValueError, match="replicas \\[5\\]"):
        dp_llm.engine.client.call("is_sleeping", replicas=[5])


def test_replica_death_fails_fast_naming_it(tiny_llama_dir, no_leftovers) -> None:
    llm = LLM(str(tiny_llama_dir), max_model_len=128, data_parallel_size=2)
    try:
        engine = llm.engine
        for i in range(4):
            engine.add_request(f"r{i}", "hello there", SamplingParams(max_tokens=100,
                                                                       ignore_eos=True))
        engine.step()
        victim = engine.client.group.procs[1].proc
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="engine core 1 .*exited unexpectedly"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 5  # hang-catcher: detection is one poll (0.1 s)
        with pytest.raises(EngineDeadError):
            engine.add_request("late", "x", SamplingParams(max_tokens=1))
    finally:
        llm.shutdown()
    assert not os.path.exists(engine.client.group.tmpdir)


def test_scale_offline(tiny_llama_dir, no_leftovers) -> None:
    """1 (in process) -> 3 -> 2 -> 3: outputs stay greedy-equal; replicas come and go."""
    prompts = ["hello there", "one two three", "the quick brown fox", "a b c"] * 2
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128)
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        for size in (3, 2, 3):
            llm.scale(size)
            client = llm.engine.client
            assert isinstance(client, MPClient)
            assert client.router.serving == list(range(size))
            assert sorted(client.group.procs) == list(range(size))  # the removed one stopped
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy,
                                                                use_tqdm=False)]
            assert got == want, size
        with pytest.raises(ValueError, match="data_parallel_size=0"):
            llm.scale(0)
    finally:
        llm.shutdown()


def test_scale_down_lets_the_removed_replica_finish(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, data_parallel_size=2)
    try:
        engine = llm.engine
        half = max(1, len(os.sched_getaffinity(0)) // 2)
        assert llm.collective_rpc(worker_threads) == [half, half]
        threads_alone = engine.client.call("collective_rpc", default_threads)[0][0]
        params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)
        for i in range(4):
            engine.add_request(f"r{i}", "hello there", params)
        owners = set(engine.client.router.owner.values())
        assert owners == {0, 1}
        llm.scale(1)  # replica 1 runs two requests: it drains, it is not killed
        assert engine.client.router.draining == {1} and 1 in engine.client.group.procs
        tokens: dict[str, int] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = len(out.outputs[0].token_ids)
        assert tokens == {f"r{i}": 60 for i in range(4)}
        assert sorted(engine.client.group.procs) == [0]
        assert engine.client.router.replicas == [0]
        # The replica left alone took the machine's cores back (torch's default for one).
        assert llm.collective_rpc(worker_threads) == [threads_alone]
    finally:
        llm.shutdown()
