"""LoRA in the scheduler and the prefix cache, on the real Scheduler and KVCacheManager (no
model): no step holds more than max_loras distinct adapters, waiting requests of another adapter
wait without blocking the base model's, and cached blocks are never shared across adapters."""

from __future__ import annotations

import pytest

from shardserve.config import SchedulerConfig
from shardserve.config.lora import LoRAConfig
from shardserve.engine.kv_cache import KVCacheManager
from shardserve.engine.request import Request
from shardserve.engine.scheduler import Scheduler
from shardserve.lora.request import LoRARequest
from shardserve.messages import SchedulerOutput
from shardserve.sampling_params import SamplingParams
from tests.engine.test_scheduler import FakeWorker, Run, drive, step

LORAS = {i: LoRARequest(f"adapter{i}", i, f"/adapters/{i}") for i in (1, 2, 3)}


def lora_req(rid: str, lora: int | LoRARequest, prompt: list[int], max_tokens: int) -> Request:
    """A request of adapter `lora` (an id of LORAS, 0 for the base model, or a LoRARequest)."""
    adapter = lora if isinstance(lora, LoRARequest) else LORAS.get(lora)
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens),
                   lora_request=adapter)


def make(max_loras: int, prefix_caching: bool = False, max_cpu_loras: int | None = None,
         **sched: object) -> tuple[Scheduler, FakeWorker]:
    """A scheduler with LoRA (max_loras > 0) or without (0)."""
    kv = KVCacheManager(128, 4, enable_prefix_caching=prefix_caching)
    lora = LoRAConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras) if max_loras else None
    s = Scheduler(SchedulerConfig(**sched), kv, 256, lora_config=lora)
    return s, FakeWorker(4)


def step_loras(so: SchedulerOutput, lora_of: dict[str, int]) -> set[int]:
    """The adapters a step holds, from the message the workers get (new requests carry their
    LoRARequest; cached ones are known from when they were new)."""
    for new in so.scheduled_new_reqs:
        lora_of[new.req_id] = new.lora_request.lora_int_id if new.lora_request else 0
    return {lora_of[rid] for rid in so.num_scheduled_tokens} - {0}


def test_no_step_holds_more_than_max_loras_adapters():
    # A small token budget: running requests are not all scheduled in every step (chunked
    # prefills), so the cap must count the running adapters, not only the scheduled ones.
    s, w = make(2, max_num_batched_tokens=12, max_num_seqs=8)
    plan = [("a1", 1, 3), ("b1", 2, 9), ("c1", 3, 4), ("base", 0, 4), ("a2", 1, 6),
            ("c2", 3, 2), ("b2", 2, 3)]
    for i, (rid, lora, n) in enumerate(plan):
        s.add_request(lora_req(rid, lora, range(10 * i, 10 * i + 7), n))
    run, lora_of, held = Run(), {}, []
    while s.has_unfinished_requests():
        assert len(run.steps) < 200
        held.append(step_loras(step(s, w, run), lora_of))
    assert max(len(h) for h in held) == 2  # the cap is reached, and never passed
    assert all(len(h) <= 2 for h in held)
    assert set().union(*held) == {1, 2, 3}  # the third adapter ran once a slot was free
    assert {rid: len(t) for rid, t in run.tokens.items()} == {r: n for r, _, n in plan}
    # The base request arrived behind adapter 3's but did not wait for it.
    def first(rid: str) -> int:
        return next(i for i, so in enumerate(run.steps) if rid in so.num_scheduled_tokens)
    assert first("base") < first("c1")


def test_waiting_adapter_keeps_its_place_in_line():
    s, w = make(1, max_num_seqs=8)
    for rid, lora in (("a", 1), ("b", 2), ("a2", 1), ("c", 3)):
        s.add_request(lora_req(rid, lora, range(5), 2))
    run = drive(s, w)
    order = []
    for so in run.steps:
        order += [n.req_id for n in so.scheduled_new_reqs]
    assert order == ["a", "a2", "b", "c"]  # b before c: passed over, not sent to the back


def test_without_lora_the_scheduler_ignores_adapters():
    s, w = make(0, max_num_seqs=8)
    for lora in (1, 2, 3):
        s.add_request(lora_req(f"r{lora}", lora, range(5), 2))
    assert len(s.schedule().scheduled_new_reqs) == 3


def test_pinned_adapters_count_against_max_cpu_loras():
    s, w = make(2, max_num_seqs=8)  # max_cpu_loras = max_loras = 2
    s.loras.pinned.add(3)  # loaded for good on every rank: one of the two places is taken
    for rid, lora in (("a", 1), ("b", 2), ("c", 3)):
        s.add_request(lora_req(rid, lora, range(5), 2))
    run = drive(s, w)
    lora_of: dict[str, int] = {}
    held = [step_loras(so, lora_of) for so in run.steps]
    assert all(len(h | {3}) <= 2 for h in held)  # never two unpinned ones, so never three
    assert {rid: len(t) for rid, t in run.tokens.items()} == {"a": 2, "b": 2, "c": 2}
    with pytest.raises(ValueError, match="max_cpu_loras=2"):
        s.loras.check_pin(4, [lora_req("x", 1, [1], 1)])  # 1 running, 3 and 4 pinned: 3 > 2
    s.loras.pinned.add(4)  # now the pins fill every place: adapter 1 could never load
    s.add_request(lora_req("never", 1, range(5), 2))
    s.add_request(lora_req("pinned_one", 3, range(5), 2))
    step(s, w, Run())
    ended = s.take_ended_outside()  # the engine core reports these with its next outputs
    assert [(o.request_id, o.finish_reason) for o in ended] == [("never", "abort")]
    assert len(drive(s, w).tokens["pinned_one"]) == 1  # its first token came with that step


def _cached_tokens(s: Scheduler, w: FakeWorker, rid: str, lora: int | LoRARequest,
                   prompt: list[int]) -> int:
    request = lora_req(rid, lora, prompt, 1)
    s.add_request(request)
    drive(s, w)
    return request.num_cached_tokens


def test_prefix_cache_is_never_shared_across_adapters():
    s, w = make(3, prefix_caching=True)
    prompt = list(range(200, 217))  # 4 full blocks and one more token
    assert _cached_tokens(s, w, "first", 1, prompt) == 0
    assert _cached_tokens(s, w, "other_adapter", 2, prompt) == 0
    assert _cached_tokens(s, w, "base", 0, prompt) == 0
    assert _cached_tokens(s, w, "same_adapter", 1, prompt) == 16  # the test can fail
    assert _cached_tokens(s, w, "base_again", 0, prompt) == 16
    # Another adapter under a known id (removed, the id given again) starts afresh too.
    reused = LoRARequest("renamed", 1, "/adapters/elsewhere")
    assert _cached_tokens(s, w, "reused_id", reused, prompt) == 0
