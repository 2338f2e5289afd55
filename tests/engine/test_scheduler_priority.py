"""Priority scheduling in the real scheduler (no model, no torch; the workers of the scheduler
tests): waiting requests are admitted by (priority, arrival), a full KV cache preempts the least
important, latest running request first, and fcfs stays as it was. With chunked prefill, prefix
caching, two steps in flight and pipeline stages."""

from __future__ import annotations

import random

import pytest
from test_scheduler import FakeWorker, Run, req, step
from test_scheduler_async import drive_async
from test_scheduler_pp import StageWorker, expected_tokens

from shardserve.config import SchedulerConfig
from shardserve.engine.kv_cache import KVCacheManager
from shardserve.engine.request import Request
from shardserve.engine.request_queue import PriorityQueue
from shardserve.engine.scheduler import Scheduler
from shardserve.sampling_params import SamplingParams

# Added at once, in this order; lower runs first, ties (b, d) by arrival.
PRIORITIES = {"a": 3, "b": 1, "c": 2, "d": 1, "e": 0, "f": -1}
BY_PRIORITY = ["f", "e", "b", "d", "c", "a"]


def make_sched(policy: str = "priority", num_blocks: int = 64, caching: bool = False,
               stages: int = 1, **sched: object) -> Scheduler:
    config = SchedulerConfig(scheduling_policy=policy, **sched)
    return Scheduler(config, KVCacheManager(num_blocks, 4, caching), 256, num_stages=stages)


def preq(rid: str, prompt_len: int, priority: int, **params: object) -> Request:
    request = req(rid, prompt_len, **params)
    request.priority = priority
    return request


def first_token_order(run: Run) -> list[str]:
    return sorted(run.tokens, key=lambda rid: run.sampled_at(rid)[0])


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_a_saturated_scheduler_runs_by_priority_then_arrival(depth, caching):
    # One request at a time; 10-token prompts in 8-token chunks (chunked prefill); identical
    # prompts, so with prefix caching all but the first start from cached blocks.
    s = make_sched(caching=caching, max_num_seqs=1, max_num_batched_tokens=8)
    for rid, priority in PRIORITIES.items():
        s.add_request(preq(rid, 10, priority, max_tokens=3))
    run = drive_async(s, FakeWorker(4), depth=depth)
    assert first_token_order(run) == BY_PRIORITY
    assert list(run.finish) == BY_PRIORITY
    assert all(len(tokens) == 3 for tokens in run.tokens.values())
    assert (s.kv.stats.hits > 0) == caching


def test_fcfs_ignores_priorities_and_keeps_arrival_order():
    s = make_sched("fcfs", max_num_seqs=1)
    for rid, priority in PRIORITIES.items():
        s.add_request(preq(rid, 5, priority, max_tokens=2))
    run = drive_async(s, FakeWorker(4), depth=2)
    assert first_token_order(run) == list(PRIORITIES)


def test_a_later_important_request_goes_ahead_of_those_waiting_not_of_those_running():
    s, w, run = make_sched(max_num_seqs=1), FakeWorker(4), Run()
    s.add_request(preq("old", 4, 5, max_tokens=4))
    s.add_request(preq("waits", 4, 5, max_tokens=4))
    step(s, w, run)
    s.add_request(preq("urgent", 4, 0, max_tokens=4))
    while s.has_unfinished_requests():
        step(s, w, run)
    assert first_token_order(run) == ["old", "urgent", "waits"]
    assert s.total_preemptions == 0  # a full batch is no memory pressure


@pytest.mark.parametrize("policy, victims", [("priority", ["low", "hi2"]), ("fcfs", ["hi2"])])
def test_memory_pressure_preempts_the_least_important_latest_first(policy, victims):
    # 6 blocks of 4 tokens; each request grows to 16 tokens (4 blocks): three cannot all fit.
    s, w, run = make_sched(policy, num_blocks=6, max_num_seqs=4), FakeWorker(4), Run()
    s.add_request(preq("low", 4, 5 if policy == "priority" else 0, max_tokens=12))
    step(s, w, run)  # admitted first: fcfs would preempt it last
    for rid in ("hi1", "hi2"):
        s.add_request(preq(rid, 4, 0, max_tokens=12))
    while s.has_unfinished_requests():
        step(s, w, run)
    preempted = [rid for so in run.steps for rid in sorted(so.preempted_req_ids)]
    assert preempted[:len(victims)] == victims
    if policy == "priority":
        assert list(run.finish) == ["hi1", "hi2", "low"]
    assert {rid: len(t) for rid, t in run.tokens.items()} == dict.fromkeys(run.tokens, 12)
    assert s.kv.num_free_blocks == 6


@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_stages_keep_priority_order_and_outputs_under_preemption(stages):
    s = make_sched(stages=stages, max_num_seqs=1, max_num_batched_tokens=32)
    for rid, priority in PRIORITIES.items():
        s.add_request(preq(rid, 6, priority, max_tokens=4))
    run = drive_async(s, StageWorker(), depth=stages)
    assert first_token_order(run) == BY_PRIORITY
    rng = random.Random(stages)
    s = make_sched(num_blocks=12, stages=stages, max_num_batched_tokens=32)  # tight: preempts
    for i in range(8):
        s.add_request(preq(f"r{i}", 6, rng.randrange(3), max_tokens=8))
    run = drive_async(s, StageWorker(), depth=stages)
    assert s.total_preemptions > 0
    assert all(run.tokens[f"r{i}"] == expected_tokens(list(range(100, 106)), 8) for i in range(8))


def test_an_aborted_waiting_request_never_runs():
    s = make_sched(max_num_seqs=1)
    for rid, priority in PRIORITIES.items():
        s.add_request(preq(rid, 5, priority, max_tokens=2))
    s.abort_requests(["e", "c"])
    assert s.num_waiting == 4
    run = drive_async(s, FakeWorker(4), depth=2)
    assert first_token_order(run) == ["f", "b", "d", "a"]


def test_the_priority_queue_pops_in_key_order_at_scale():
    """10k requests with removals and put-backs: O(log n) each (a quadratic queue would take
    minutes here)."""
    rng, params = random.Random(0), SamplingParams()
    queue, requests = PriorityQueue(), []
    for i in range(10_000):
        # Some equal arrival stamps.
        requests.append(Request(f"r{i}", [1], params, arrival_time=float(i // 3),
                                priority=rng.randrange(-5, 5)))
        queue.add(requests[-1])
    removed = set(rng.sample(requests, 2_500))
    for request in removed:
        queue.remove(request)
    popped = [queue.pop() for _ in range(100)]
    queue.put_back(popped[::-1])  # as a preempted request returns: by its key again
    assert len(queue) == 7_500 and popped[0] in queue and next(iter(removed)) not in queue
    order = [queue.pop() for _ in range(len(queue))]
    live = [r for r in requests if r not in removed]
    assert set(order) == set(live) and not queue
    keys = [(r.priority, r.arrival_time) for r in order]
    assert keys == sorted(keys)


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"scheduling_policy='lifo' is not supported; choose "
                                         r"one of: fcfs, priority"):
        SchedulerConfig(scheduling_policy="lifo")
