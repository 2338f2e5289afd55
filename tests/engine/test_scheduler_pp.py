"""The scheduler with pipeline stages, no model, no torch: requests split into one micro-batch
per stage, a request is never scheduled while its token is in flight, and the workers learn
every token from `new_token_ids` (a stage never sees what the last stage sampled)."""

from __future__ import annotations

import random

import numpy as np
from test_scheduler import req
from test_scheduler_async import drive_async

from shardserve.config import SchedulerConfig
from shardserve.engine.kv_cache import KVCacheManager
from shardserve.engine.scheduler import Scheduler
from shardserve.messages import ModelRunnerOutput, SchedulerOutput


class StageWorker:
    """A first-stage worker: knows only what the scheduler sends. The token it 'samples' for a
    request is a function of the request's tokens so far, so a stale or missing token changes
    everything after it."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.tokens.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        assert len(cached.new_token_ids) == len(cached.req_ids)
        for rid, computed, new_tokens in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_token_ids, strict=True
        ):
            self.tokens[rid].extend(new_tokens)
            assert self.computed[rid] == computed, rid
        sampled, values = [], []
        for rid, n in so.num_scheduled_tokens.items():
            self.computed[rid] += n
            # Every token it computes must be known: no placeholder is ever scheduled.
            assert self.computed[rid] <= len(self.tokens[rid]), f"{rid} ran past its tokens"
            if self.computed[rid] == len(self.tokens[rid]):
                sampled.append(rid)
                values.append(sum(self.tokens[rid]) % 97 + 3)
        return ModelRunnerOutput(sampled, np.asarray(values, dtype=np.int64))


def make_pp(stages: int, **sched: object) -> Scheduler:
    config = SchedulerConfig(**{"max_num_batched_tokens": 64, **sched})
    return Scheduler(config, KVCacheManager(256, 4), 256, num_stages=stages)


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        out.append(sum(tokens) % 97 + 3)
        tokens.append(out[-1])
    return out


def test_micro_batches_split_the_requests_evenly():
    s = make_pp(2)
    for i in range(8):
        s.add_request(req(f"r{i}", 3, max_tokens=4))
    first, second, third = s.schedule(), s.schedule(), s.schedule()
    assert len(first.num_scheduled_tokens) == 4 and len(second.num_scheduled_tokens) == 4
    assert not set(first.num_scheduled_tokens) & set(second.num_scheduled_tokens)
    # Everything is in flight: nothing more until a result comes back.
    assert third.total_num_scheduled_tokens == 0


def test_a_request_waits_for_its_token_and_then_carries_it():
    s, w = make_pp(2), StageWorker()
    s.add_request(req("a", 3, max_tokens=3))
    so = s.schedule()
    out = w.execute(so)
    assert s.schedule().total_num_scheduled_tokens == 0  # its token is in flight
    s.update_from_output(so, out)
    nxt = s.schedule()
    assert nxt.scheduled_cached_reqs.req_ids == ["a"]
    assert nxt.scheduled_cached_reqs.new_token_ids == [[int(out.sampled_token_ids[0])]]


def test_every_request_gets_the_tokens_a_single_stage_would():
    rng = random.Random(3)
    for stages in (2, 3):
        s, w = make_pp(stages, max_num_seqs=5, max_num_batched_tokens=24), StageWorker()
        lengths = {f"r{i}": rng.randrange(1, 40) for i in range(12)}
        for rid, n in lengths.items():
            s.add_request(req(rid, n, max_tokens=6))
        run = drive_async(s, w, depth=stages)  # checks the invariants at every step
        for rid, n in lengths.items():
            assert run.tokens[rid] == expected_tokens(list(range(100, 100 + n)), 6), rid


def test_preemption_with_stages_keeps_outputs():
    s, w = make_pp(2, max_num_batched_tokens=32), StageWorker()
    s.kv = KVCacheManager(12, 4)  # tight: forces preemptions
    for i in range(6):
        s.add_request(req(f"r{i}", 6, max_tokens=8))
    run = drive_async(s, w, depth=2)
    assert s.total_preemptions > 0
    for i in range(6):
        assert run.tokens[f"r{i}"] == expected_tokens(list(range(100, 106)), 8)
