"""The scheduler's speculative decoding with one and two steps in flight, no model, no torch.

Each request's "model" is a fixed sequence of tokens (`target`); the worker below proposes
drafts that agree with it for a random number of tokens, then differ, and verifies as the real
one does (accepted drafts, then the target's token). With two steps in flight the scheduler
cannot know how many drafts the step in flight accepts, so it sends draft slots and the worker
places the request itself: the test checks that every position the worker computes lies in
the request's blocks, that the count the scheduler sends is exact for a request without slots
and an upper bound with them, that the outputs are the targets whatever was accepted, and that
no block is left owned.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest
from test_scheduler import req
from test_scheduler_async import drive_async

from shardserve.config import SchedulerConfig
from shardserve.config.speculative import SpeculativeConfig
from shardserve.engine.kv_cache import KVCacheManager
from shardserve.engine.scheduler import Scheduler
from shardserve.messages import ModelRunnerOutput, SchedulerOutput

K = 4


def target(rid: str, i: int) -> int:
    """The token at position i of the request's output."""
    return 100 + zlib.crc32(f"{rid}:{i}".encode()) % 50


@dataclass
class SpecWorker:
    block_size: int
    max_model_len: int
    rng: random.Random
    reqs: dict[str, dict] = field(default_factory=dict)
    slot_steps: int = 0  # steps of a request whose drafts this worker filled in

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = {"prompt": len(new.prompt_token_ids),
                                     "out": list(new.output_token_ids), "drafts": [],
                                     "computed": new.num_computed_tokens,
                                     "blocks": list(new.block_ids)}
        cached = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                         cached.num_computed_tokens, strict=True):
            state = self.reqs[rid]
            state["blocks"] += blocks
            if rid in so.draft_slots:
                assert computed >= state["computed"], rid  # an upper bound
            else:
                assert computed == state["computed"], rid
                state["computed"] = computed
        order = cached.req_ids + [n.req_id for n in so.scheduled_new_reqs]
        return self._run(order, so)

    def _run(self, order: list[str], so: SchedulerOutput) -> ModelRunnerOutput:
        rids, tokens, counts, verified = [], [], [], []
        for rid in order:
            s = self.reqs[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            n = so.num_scheduled_tokens[rid]
            if rid in so.draft_slots:
                self.slot_steps += 1
                drafts = s["drafts"][:so.draft_slots[rid]]
                n = 1 + len(drafts)
            num_tokens = s["prompt"] + len(s["out"])
            s["computed"] += n
            assert len(s["blocks"]) * self.block_size >= s["computed"], "KV past the table"
            assert s["computed"] < self.max_model_len, "a position past max_model_len"
            if s["computed"] - len(drafts) != num_tokens:
                continue  # mid-prefill
            emitted = []
            for d in [*drafts, None]:
                want = target(rid, len(s["out"]) + len(emitted))
                emitted.append(want)
                if d != want:
                    break
            s["computed"] -= len(drafts) + 1 - len(emitted)
            s["out"] += emitted
            s["drafts"] = self._propose(rid, len(s["out"]))
            rids.append(rid)
            tokens += emitted
            counts.append(len(emitted))
            verified.append(len(drafts))
        return ModelRunnerOutput(
            req_ids=rids, sampled_token_ids=np.asarray(tokens, np.int64),
            num_sampled=np.asarray(counts, np.int64), num_drafts=np.asarray(verified, np.int64),
            draft_token_ids={rid: self.reqs[rid]["drafts"] for rid in rids})

    def _propose(self, rid: str, start: int) -> list[int]:
        good = self.rng.randrange(K + 1)
        return [target(rid, start + j) if j < good else 1 for j in range(self.rng.randrange(K + 1))]


def _scheduler(num_blocks: int, max_model_len: int, **sched: object) -> Scheduler:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, max_verify_rows=0,
                             max_batch_for_speculation=64, min_acceptance_rate=0.0)
    return Scheduler(SchedulerConfig(**sched), KVCacheManager(num_blocks, 4), max_model_len,
                     speculative_config=spec)


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
@pytest.mark.parametrize("num_blocks", [200, 14], ids=["roomy", "preempting"])
def test_outputs_whatever_the_drafts_accept(depth, num_blocks):
    rng = random.Random(depth * 1000 + num_blocks)
    s = _scheduler(num_blocks, 48, max_num_seqs=4, max_num_batched_tokens=24)
    w = SpecWorker(4, 48, rng)
    limits = {f"r{i}": rng.randrange(1, 40) for i in range(16)}
    prompts = {rid: rng.randrange(1, 24) for rid in limits}
    for rid, n in limits.items():
        s.add_request(req(rid, prompts[rid], max_tokens=n))
    out = drive_async(s, w, depth, max_steps=2500).tokens
    # max_tokens, or the model's length (48 tokens) first.
    assert out == {rid: [target(rid, i) for i in range(min(n, 48 - prompts[rid]))]
                   for rid, n in limits.items()}
    assert s.spec.stats.num_accepted_tokens > 0
    assert (w.slot_steps > 0) == (depth == 2)  # the workers placed requests only when async
    assert s.kv.num_free_blocks == num_blocks
    if num_blocks == 14:
        assert s.total_preemptions > 0
