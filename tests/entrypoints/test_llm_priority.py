"""Priority scheduling through the real engine (tiny random model, async scheduling on): a
saturated engine finishes requests by priority then arrival, a full KV cache preempts the least
important running request first (fcfs: the latest), and bad values are refused before anything
is queued. The KV cache holds 8 blocks of 4 tokens; each request grows to 16-20 tokens."""

from __future__ import annotations

import argparse

import pytest

from shardserve import LLM, EngineArgs, SamplingParams
from shardserve.engine.core_wire import EngineRequest, decode, encode

TINY_KV = dict(dtype="float32", max_model_len=32, block_size=4, num_blocks_override=8, seed=0)


@pytest.fixture(scope="module")
def prio_llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), scheduling_policy="priority", **TINY_KV)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def fcfs_llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **TINY_KV)
    yield llm
    llm.shutdown()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def prompt(i: int) -> list[int]:
    return [10 + 4 * i + k for k in range(4)]


def run_steps(llm: LLM, on_step=None) -> list[str]:
    """Step the engine until idle; the request ids in the order they finished."""
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += [out.request_id for out in llm.engine.step() if out.finished]
        if on_step is not None:
            on_step()
    return finished


def test_a_saturated_engine_finishes_by_priority_then_arrival(prio_llm):
    priorities = {"a": 2, "b": 0, "c": 1, "d": 0}
    for i, (rid, priority) in enumerate(priorities.items()):
        prio_llm.engine.add_request(rid, prompt(i), params(16), priority=priority)
    assert run_steps(prio_llm) == ["b", "d", "c", "a"]
    # The same through LLM.generate: one priority per prompt, outputs in input order.
    outs = prio_llm.generate([prompt(i) for i in range(4)], params(16), use_tqdm=False,
                             priority=list(priorities.values()))
    finish_order = sorted(range(4), key=lambda i: outs[i].metrics.finished_time)
    assert finish_order == [1, 3, 2, 0]
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "hi2")])
def test_a_full_kv_cache_preempts_the_least_important_running_request_first(
        prio_llm, fcfs_llm, policy, victim):
    llm = prio_llm if policy == "priority" else fcfs_llm
    sched = llm.engine.core.scheduler
    llm.engine.add_request("low", prompt(0), params(12), priority=5 if policy == "priority" else 0)
    while not any(r.request_id == "low" for r in sched.running):
        llm.engine.step()
    for i, rid in ((1, "hi1"), (2, "hi2")):
        llm.engine.add_request(rid, prompt(i), params(12))  # priority 0, admitted later
    preempted: list[str] = []

    def note_preemptions() -> None:
        preempted.extend(rid for rid, r in sched.requests.items()
                         if r.num_preemptions and rid not in preempted)

    finished = run_steps(llm, note_preemptions)
    assert preempted[0] == victim
    if policy == "priority":
        assert finished == ["hi1", "hi2", "low"]


def test_chat_takes_priorities_too(prio_llm):
    conversations = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    outs = prio_llm.chat(conversations, params(2), use_tqdm=False, priority=[1, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


def test_fcfs_takes_priority_zero_and_refuses_any_other(fcfs_llm):
    outs = fcfs_llm.generate([prompt(0), prompt(1)], params(1), use_tqdm=False, priority=[0, 0])
    assert len(outs) == 2
    for call in (lambda: fcfs_llm.generate([prompt(0), prompt(1)], params(1), use_tqdm=False,
                                           priority=[0, 1]),
                 lambda: fcfs_llm.engine.add_request("x", prompt(0), params(1), priority=-3)):
        with pytest.raises(ValueError, match=r"needs priority scheduling, but this engine runs "
                                             r"scheduling_policy='fcfs'; start it with "
                                             r"scheduling_policy='priority'"):
            call()
    assert not fcfs_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("priority, message", [
    ([1], "got 1 priorities for 2 prompts; give one per prompt"),
    ([0, 1.5], "priority must be an int, got 1.5"),
    ([True, 0], "priority must be an int, got True"),
    (3, "priority must be a list of ints, one per prompt, got 3"),
])
def test_bad_priorities_are_refused_before_anything_is_queued(prio_llm, priority, message):
    with pytest.raises(ValueError, match=message):
        prio_llm.generate([prompt(0), prompt(1)], params(1), use_tqdm=False, priority=priority)
    assert not prio_llm.engine.has_unfinished_requests()


def test_the_priority_crosses_to_engine_core_processes(prio_llm):
    req = prio_llm.engine.inputs.process("r", prompt(0), SamplingParams(n=2), priority=-7)
    for core_request in req.core_requests():
        sent = decode(encode(EngineRequest("add", request=core_request)))  # the wire to a core
        assert sent.request.priority == -7 and sent.request.to_request().priority == -7


def test_the_policy_is_an_engine_option_and_a_flag(tiny_llama_dir):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--scheduling-policy", "priority"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.scheduler_config.scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy='lifo' is not supported; choose one "
                                         "of: fcfs, priority"):
        LLM(str(tiny_llama_dir), scheduling_policy="lifo")
