"""Scheduler unit tests: no model, no torch.

A FakeWorker keeps only what the SchedulerOutput messages tell it (as a real worker does) and
samples a fixed token for each request whose prefill completes in the step, i.e. when
num_computed_tokens + scheduled == num_tokens before the step. It also checks the message
protocol: a request is sent in full once, then only as deltas that agree with the worker's state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from shardserve.config import SchedulerConfig
from shardserve.engine.kv_cache import KVCacheManager
from shardserve.engine.request import Request
from shardserve.engine.scheduler import Scheduler
from shardserve.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from shardserve.sampling_params import SamplingParams

TOKEN = 7


@dataclass
class WorkerReq:
    tokens: list[int]
    computed: int
    blocks: list[int]


@dataclass
class FakeWorker:
    block_size: int
    token: int = TOKEN
    reqs: dict[str, WorkerReq] = field(default_factory=dict)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent in full twice"
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.reqs[new.req_id] = WorkerReq(tokens, new.num_computed_tokens, list(new.block_ids))
        cached = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.reqs[rid]
            assert state.computed == computed, rid
            state.blocks += blocks
        order = cached.req_ids + [n.req_id for n in so.scheduled_new_reqs]
        assert sorted(order) == sorted(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=(sampled := self._run(order, so)),
            sampled_token_ids=np.full(len(sampled), self.token, dtype=np.int64),
        )

    def _run(self, order: list[str], so: SchedulerOutput) -> list[str]:
        sampled = []
        for rid in order:
            state = self.reqs[rid]
            state.computed += so.num_scheduled_tokens[rid]
            assert 0 < so.num_scheduled_tokens[rid] and state.computed <= len(state.tokens)
            assert len(state.blocks) * self.block_size >= state.computed, "KV written past table"
            if state.computed == len(state.tokens):
                sampled.append(rid)
                state.tokens.append(self.token)
        return sampled


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    **sched: object,
) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(**sched)
    return Scheduler(config, KVCacheManager(num_blocks, block_size), max_model_len), FakeWorker(
        block_size
    )


def req(rid: str, prompt_len: int, eos: tuple[int, ...] = (), **params: object) -> Request:
    return Request(rid, list(range(100, 100 + prompt_len)), SamplingParams(**params), eos)


def check_invariants(s: Scheduler, so: SchedulerOutput) -> None:
    kv = s.kv
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= s.config.max_num_seqs
    assert s.num_running <= s.config.max_num_seqs
    owned = [b for rid in list(kv._tables) for b in kv.block_ids(rid)]
    free = list(kv._free)
    assert len(owned) == len(set(owned)), "a block id is owned twice"
    assert not set(owned) & set(free), "a block id is free and owned"
    assert sorted(owned + free) == list(range(kv.num_blocks))
    holders = {rid for rid in kv._tables if kv.block_ids(rid)}
    assert holders <= {r.request_id for r in s.running}, "a non-running request holds blocks"


@dataclass
class Run:
    """What a driven scheduler produced: per-step outputs and each request's result."""

    steps: list[SchedulerOutput] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, EngineCoreOutput] = field(default_factory=dict)

    def sampled_at(self, rid: str) -> list[int]:
        return [i for i, so in enumerate(self.steps) if rid in self._sampled[i]]

    _sampled: list[set[str]] = field(default_factory=list)


def step(s: Scheduler, w: FakeWorker, run: Run) -> SchedulerOutput:
    so = s.schedule()
    check_invariants(s, so)
    out = w.execute(so)
    for rid in so.num_scheduled_tokens:  # the deltas rebuilt the scheduler's block table
        assert w.reqs[rid].blocks == s.kv.block_ids(rid), rid
    record(run, so, out, s.update_from_output(so, out))
    return so


def record(run: Run, so: SchedulerOutput, out: ModelRunnerOutput, res: list) -> None:
    run.steps.append(so)
    run._sampled.append(set(out.req_ids))
    for o in res:
        run.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            run.finish[o.request_id] = o


def drive(s: Scheduler, w: FakeWorker, max_steps: int = 500) -> Run:
    run = Run()
    while s.has_unfinished_requests():
        assert len(run.steps) < max_steps, "scheduler made no progress"
        step(s, w, run)
    return run


# ---- budget, batch size, chunked prefill ----
def test_budget_and_max_num_seqs_hold_every_step():
    s, w = make(num_blocks=256, max_num_seqs=3, max_num_batched_tokens=20)
    rng = random.Random(1)
    lengths = {f"r{i}": rng.randrange(1, 45) for i in range(10)}
    for rid, n in lengths.items():
        s.add_request(req(rid, n, max_tokens=5))
    run = drive(s, w)
    assert {rid: len(t) for rid, t in run.tokens.items()} == dict.fromkeys(lengths, 5)
    assert max(len(so.num_scheduled_tokens) for so in run.steps) == 3
    assert all(o.finish_reason == "length" for o in run.finish.values())


def test_chunked_prefill_splits_a_long_prompt_and_samples_after_the_last_chunk():
    s, w = make(max_num_batched_tokens=16)
    s.add_request(req("a", 50, max_tokens=3))
    run = drive(s, w)
    assert [so.num_scheduled_tokens["a"] for so in run.steps] == [16, 16, 16, 2, 1, 1]
    assert run.sampled_at("a") == [3, 4, 5]
    assert run.tokens["a"] == [TOKEN] * 3


def test_decodes_go_first_then_a_new_prompt_takes_the_rest_of_the_budget():
    s, w = make(max_num_batched_tokens=16)
    s.add_request(req("a", 10, max_tokens=4))
    run = Run()
    step(s, w, run)
    s.add_request(req("b", 30, max_tokens=2))
    so = step(s, w, run)
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert "b" not in run._sampled[-1]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits():
    s, w = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    s.add_request(req("a", 10, max_tokens=4))
    s.add_request(req("b", 8, max_tokens=4))
    run = Run()
    so = step(s, w, run)
    assert so.num_scheduled_tokens == {"a": 10}  # b would need 8 of the 6 left: no chunk
    assert s.num_waiting == 1
    so = step(s, w, run)
    assert so.num_scheduled_tokens == {"a": 1, "b": 8}
    assert "b" in run._sampled[-1]


def test_with_chunked_prefill_the_same_prompt_is_split():
    s, w = make(max_num_batched_tokens=16)
    s.add_request(req("a", 10, max_tokens=4))
    s.add_request(req("b", 8, max_tokens=4))
    so = step(s, w, Run())
    assert so.num_scheduled_tokens == {"a": 10, "b": 6}


# ---- messages: in full once, then deltas ----
def test_new_request_sent_in_full_once_then_as_block_deltas():
    s, w = make(block_size=4)
    s.add_request(req("a", 6, max_tokens=8))
    run = drive(s, w)
    first = run.steps[0].scheduled_new_reqs
    assert [n.req_id for n in first] == ["a"] and len(first[0].block_ids) == 2
    assert first[0].num_computed_tokens == 0 and first[0].prompt_token_ids == list(range(100, 106))
    assert all(not so.scheduled_new_reqs for so in run.steps[1:])
    deltas = [so.scheduled_cached_reqs for so in run.steps[1:]]
    assert all(d.req_ids == ["a"] for d in deltas)
    # Step k (k >= 1) computes token 6 + k - 1, so the table grows at tokens 8 and 12.
    assert [d.num_computed_tokens[0] for d in deltas] == list(range(6, 13))
    assert [len(d.new_block_ids[0]) for d in deltas] == [0, 0, 1, 0, 0, 0, 1]


# ---- preemption by recompute ----
def test_preemption_recomputes_the_newest_request_and_all_finish():
    s, w = make(num_blocks=6, block_size=4)
    for rid in "abc":
        s.add_request(req(rid, 4, max_tokens=12))
    run = Run()
    outputs_when_preempted: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        assert len(run.steps) < 200
        running_before = [r.request_id for r in s.running]
        so = step(s, w, run)
        if so.preempted_req_ids:  # the newest admitted requests, and nothing new admitted
            assert so.preempted_req_ids == set(running_before[-len(so.preempted_req_ids):])
            assert not so.preempted_req_ids & set(so.num_scheduled_tokens)
            assert not so.scheduled_new_reqs
        for rid in so.preempted_req_ids:
            outputs_when_preempted[rid] = list(run.tokens.get(rid, []))
        for new in so.scheduled_new_reqs:
            if new.req_id in outputs_when_preempted:
                assert new.output_token_ids == outputs_when_preempted.pop(new.req_id)
                assert new.num_computed_tokens == 0
    preempted = [rid for so in run.steps for rid in so.preempted_req_ids]
    assert preempted and preempted[0] == "c"  # the newest admitted goes first
    assert {rid: len(t) for rid, t in run.tokens.items()} == {"a": 12, "b": 12, "c": 12}
    assert all(o.finish_reason == "length" for o in run.finish.values())
    assert s.kv.num_free_blocks == 6


@pytest.mark.parametrize("seed", [7, 8])
@pytest.mark.parametrize("chunked", [True, False])
def test_random_workload_keeps_invariants_and_finishes_everything(seed, chunked):
    rng = random.Random(seed)
    budget = 24 if chunked else 64  # without chunking the budget must cover max_model_len
    s, w = make(num_blocks=24, block_size=4, max_model_len=64, max_num_seqs=5,
                max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    want = {}
    for i in range(30):
        want[f"r{i}"] = rng.randrange(1, 20)
        s.add_request(req(f"r{i}", rng.randrange(1, 40), max_tokens=want[f"r{i}"]))
    run = drive(s, w, max_steps=2000)
    assert {rid: len(t) for rid, t in run.tokens.items()} == want
    assert any(so.preempted_req_ids for so in run.steps)
    assert s.kv.num_free_blocks == 24 and not s.requests


# ---- finish reasons ----
@pytest.mark.parametrize(
    ("eos", "params", "n_tokens", "reason", "stop_reason"),
    [
        ((), {"stop_token_ids": [TOKEN], "max_tokens": 9}, 1, "stop", TOKEN),
        ((TOKEN,), {"max_tokens": 9}, 1, "stop", None),
        ((TOKEN,), {"max_tokens": 9, "ignore_eos": True}, 9, "length", None),
        ((TOKEN,), {"max_tokens": 9, "min_tokens": 3}, 3, "stop", None),
        ((), {"stop_token_ids": [TOKEN], "max_tokens": 9, "min_tokens": 4}, 4, "stop", TOKEN),
        ((), {"max_tokens": 5}, 5, "length", None),
        ((), {"max_tokens": None}, 12, "length", None),  # prompt 4 + 12 = max_model_len 16
    ],
)
def test_finish_reasons(eos, params, n_tokens, reason, stop_reason):
    s, w = make(max_model_len=16)
    s.add_request(req("a", 4, eos=eos, **params))
    run = drive(s, w)
    assert run.tokens["a"] == [TOKEN] * n_tokens
    assert run.finish["a"].finish_reason == reason
    assert run.finish["a"].stop_reason == stop_reason
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_finished_ids_reach_the_workers_once():
    s, w = make()
    s.add_request(req("a", 3, max_tokens=1))
    run = Run()
    step(s, w, run)
    assert run.finish["a"].finish_reason == "length"
    assert s.schedule().finished_req_ids == {"a"}
    assert s.schedule().finished_req_ids == set()


# ---- aborts ----
def test_abort_frees_blocks_and_is_reported_next_step():
    s, w = make(num_blocks=16)
    s.add_request(req("a", 10, max_tokens=20))
    s.add_request(req("b", 10, max_tokens=3))
    s.add_request(req("c", 5, max_tokens=3))
    run = Run()
    step(s, w, run)
    s.abort_requests(["a", "unknown"])
    so = step(s, w, run)
    assert "a" in so.finished_req_ids and "a" not in so.num_scheduled_tokens
    assert s.kv.block_ids("a") == [] and "a" not in w.reqs
    s.abort_requests(["a"])  # twice: a no-op
    rest = drive(s, w)
    assert not any("a" in so.finished_req_ids for so in rest.steps)
    assert len(run.tokens["b"]) + len(rest.tokens.get("b", [])) == 3
    assert s.kv.num_free_blocks == 16


def test_abort_of_a_waiting_request():
    s, w = make(max_num_seqs=1)
    s.add_request(req("a", 4, max_tokens=2))
    s.add_request(req("b", 4, max_tokens=2))
    run = Run()
    step(s, w, run)
    s.abort_requests(["b"])
    assert s.num_waiting == 0
    rest = drive(s, w)
    assert "b" not in rest.tokens and "b" not in run.tokens
    assert len(run.tokens["a"]) + len(rest.tokens["a"]) == 2


def test_abort_during_a_step_drops_that_requests_output():
    s, w = make(num_blocks=16)
    s.add_request(req("a", 4, max_tokens=5))
    s.add_request(req("b", 4, max_tokens=5))
    so = s.schedule()
    out = w.execute(so)
    assert sorted(out.req_ids) == ["a", "b"]
    s.abort_requests(["a"])
    results = s.update_from_output(so, out)
    assert [o.request_id for o in results] == ["b"]
    assert s.kv.block_ids("a") == [] and s.kv.num_free_blocks == 15
    nxt = s.schedule()
    assert nxt.finished_req_ids == {"a"} and nxt.num_scheduled_tokens == {"b": 1}


def test_random_arrivals_and_aborts_keep_invariants():
    rng = random.Random(3)
    s, w = make(num_blocks=20, block_size=4, max_model_len=64, max_num_seqs=4,
                max_num_batched_tokens=16)
    run, aborted, want, next_id = Run(), set(), {}, 0
    while next_id < 40 or s.has_unfinished_requests():
        assert len(run.steps) < 3000
        if next_id < 40 and rng.random() < 0.5:
            rid, next_id = f"r{next_id}", next_id + 1
            want[rid] = rng.randrange(1, 15)
            s.add_request(req(rid, rng.randrange(1, 30), max_tokens=want[rid]))
        if not s.has_unfinished_requests():
            continue
        so = s.schedule()
        check_invariants(s, so)
        out = w.execute(so)
        if so.num_scheduled_tokens and rng.random() < 0.1:  # abort mid-step
            victim = rng.choice(sorted(so.num_scheduled_tokens))
            s.abort_requests([victim])
            aborted.add(victim)
        res = s.update_from_output(so, out)
        assert not {o.request_id for o in res} & aborted
        record(run, so, out, res)
    done = {rid for rid in want if rid not in aborted}
    assert {rid: len(run.tokens[rid]) for rid in done} == {rid: want[rid] for rid in done}
    assert all(len(run.tokens.get(rid, [])) < want[rid] for rid in aborted)
    assert s.kv.num_free_blocks == 20


def test_logprobs_rows_follow_their_request():
    s, w = make()
    s.add_request(req("a", 4, max_tokens=3))
    s.add_request(req("b", 4, max_tokens=3))
    so = s.schedule()
    w.execute(so)
    out = ModelRunnerOutput(
        req_ids=["a", "b"],
        sampled_token_ids=np.array([5, 9]),
        logprob_token_ids=np.array([[5, 5, 6], [9, 3, 9]]),
        logprobs=np.array([[-0.5, -0.5, -1.5], [-2.0, -0.1, -2.0]]),
        sampled_token_ranks=np.array([1, 2]),
    )
    res = {o.request_id: o for o in s.update_from_output(so, out)}
    assert res["a"].new_token_ids == [5]
    assert res["a"].new_logprobs == [{5: (-0.5, 1), 6: (-1.5, 2)}]
    assert res["b"].new_logprobs == [{9: (-2.0, 2), 3: (-0.1, 1)}]
