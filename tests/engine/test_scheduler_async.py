"""The scheduler with two steps in flight (asynchronous scheduling), no model, no torch.

Steps are planned one ahead: step N+1 is scheduled before step N's tokens are folded in, as
EngineCore's batch queue does. The FakeWorker of test_scheduler.py executes each step in order
(as real workers do) and feeds each request the token it sampled itself; it checks that every
delta agrees with its own state, so a token scheduled twice or a wrong count fails there.
"""

from __future__ import annotations

import random
from collections import deque

from test_scheduler import TOKEN, FakeWorker, Run, check_invariants, make, record, req

from shardserve.engine.scheduler import Scheduler


def drive_async(
    s: Scheduler, w: FakeWorker, depth: int = 2, on_result=None, max_steps: int = 2000
) -> Run:
    run = Run()
    queue: deque = deque()
    for _ in range(max_steps * depth):  # a bound, so a scheduler that loops fails, not hangs
        if not (s.has_unfinished_requests() or queue):
            return run
        if len(queue) < depth and s.has_unfinished_requests():
            so = s.schedule()
            check_invariants(s, so)
            if so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids:
                queue.append((so, w.execute(so)))
                if len(queue) < depth:
                    continue
        if queue:
            so, out = queue.popleft()
            res = s.update_from_output(so, out)
            record(run, so, out, res)
            if on_result is not None:
                on_result(s, res)
    raise AssertionError(f"no end after {max_steps * depth} iterations: no progress")


def test_each_request_gets_exactly_max_tokens():
    s, w = make(num_blocks=256, max_num_seqs=3, max_num_batched_tokens=20)
    rng = random.Random(1)
    lengths = {f"r{i}": rng.randrange(1, 45) for i in range(10)}
    for rid, n in lengths.items():
        s.add_request(req(rid, n, max_tokens=5))
    run = drive_async(s, w)
    assert {rid: len(t) for rid, t in run.tokens.items()} == dict.fromkeys(lengths, 5)
    assert all(o.finish_reason == "length" for o in run.finish.values())
    # Never scheduled past the limit, placeholders counted: each request sampled exactly 5
    # times on the worker, though its 5th token was always still in flight at planning time.
    assert all(sum(rid in sampled for sampled in run._sampled) == 5 for rid in lengths)
    assert s.kv.num_free_blocks == 256


def test_a_stop_found_late_discards_the_token_in_flight():
    s, w = make(num_blocks=64)
    s.add_request(req("a", 4, max_tokens=10, stop_token_ids=[TOKEN]))
    s.add_request(req("b", 6, max_tokens=3))
    run = drive_async(s, w)
    assert run.tokens == {"a": [TOKEN], "b": [TOKEN] * 3}
    assert run.finish["a"].finish_reason == "stop" and run.finish["a"].stop_reason == TOKEN
    # "a" had a second token in flight when its stop was seen: the worker sampled it...
    assert sum("a" in sampled for sampled in run._sampled) == 2
    # ...and was told to drop the request afterwards.
    assert any("a" in so.finished_req_ids for so in run.steps)
    assert s.kv.num_free_blocks == 64


def test_placeholders_are_computed_once():
    s, w = make(num_blocks=64, max_num_batched_tokens=16)
    s.add_request(req("a", 10, max_tokens=4))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 10}
    w.execute(first)
    # Step 2 is planned before step 1's token is known: it computes that token (1 new token).
    second = s.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    w.execute(second)
    request = s.requests["a"]
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 11
    s.update_from_output(first, _out(["a"]))
    assert request.num_output_placeholders == 1 and request.output_token_ids == [TOKEN]


def _out(rids):
    import numpy as np

    from shardserve.messages import ModelRunnerOutput

    return ModelRunnerOutput(req_ids=rids, sampled_token_ids=np.full(len(rids), TOKEN))


def test_random_arrivals_aborts_and_preemption_keep_invariants():
    rng = random.Random(5)
    s, w = make(num_blocks=14, block_size=4, max_model_len=48, max_num_seqs=4,
                max_num_batched_tokens=16)  # fmt: skip
    want = {f"r{i}": rng.randrange(1, 15) for i in range(30)}
    for rid, n in want.items():
        s.add_request(req(rid, rng.randrange(1, 25), max_tokens=n))
    aborted: set[str] = set()
    seen_after_abort: list[str] = []

    def maybe_abort(sched: Scheduler, res: list) -> None:
        seen_after_abort.extend(o.request_id for o in res if o.request_id in aborted)
        if sched.running and rng.random() < 0.08:
            victim = rng.choice(sched.running).request_id
            sched.abort_requests([victim])
            aborted.add(victim)

    run = drive_async(s, w, on_result=maybe_abort)
    assert not seen_after_abort
    assert s.total_preemptions > 0
    done = {rid for rid in want if rid not in aborted}
    assert {rid: len(run.tokens[rid]) for rid in done} == {rid: want[rid] for rid in done}
    assert all(len(run.tokens.get(rid, [])) < want[rid] for rid in aborted)
    assert s.kv.num_free_blocks == 14
