"""Continuous batching: which requests run this step, and how many tokens each.

Each step spends a token budget (`max_num_batched_tokens`) first on running requests (one token
per decode, a chunk for an unfinished prefill), then admits waiting requests in the policy's
order (request_queue.py: arrival, or priority then arrival). When the block pool runs dry, the
last running request in that order (fcfs: the most recently admitted) is preempted: its blocks
are freed and it is recomputed from scratch later (preemption by recompute).

Asynchronous scheduling: a request's `num_computed_tokens` advances when its tokens are
*scheduled*, not when the step returns, so a step can be planned while earlier ones still run and
no token is ever scheduled twice. A scheduled step that completes a request's known tokens will
sample one more, whose id the scheduler learns only later: it is counted in
`num_output_placeholders` until `update_from_output` replaces it with the real token. The next
step may already compute that placeholder (the workers feed each request the token they sampled
themselves), so with two batches in flight the model never waits for the engine. A request is
never scheduled past its limits (max_tokens, max_model_len) counting its placeholders; a request
found finished late (EOS, stop token, abort) has the tokens still in flight for it discarded.

Pipeline parallelism (`num_stages` > 1): the engine keeps one batch in flight per stage, so the
scheduler splits the requests into micro-batches of at most ceil(unfinished / num_stages) each.
A stage cannot see what the last stage sampled, so a request with a token in flight is not
scheduled again until that token is back, and each scheduled request carries the tokens the
workers have not been sent yet (`CachedRequestData.new_token_ids`).

Speculative decoding (engine/spec_decode_scheduling.py): a decode may verify the drafts the
workers proposed with its last step, as 1 + d query positions; the rejected ones are rolled back
when the step's tokens are folded in.

LoRA (engine/lora_scheduling.py): the running requests never name more than max_loras distinct
adapters (nor more than max_cpu_loras with the pinned ones). A waiting request of another
adapter is passed over (it keeps its place) until a running adapter's last request finishes;
requests of the base model or of a running adapter are admitted past it. Every step schedules a
subset of the running requests, so no step holds more either.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shardserve.config import SchedulerConfig
from shardserve.config.lora import LoRAConfig
from shardserve.engine.kv_cache import KVCacheManager
from shardserve.engine.lora_scheduling import LoRAAdmission
from shardserve.engine.request import Request, RequestStatus
from shardserve.engine.request_queue import RequestQueue, make_request_queue
from shardserve.engine.scheduler_results import SchedulerResults
from shardserve.engine.spec_decode_scheduling import SpecDecodeScheduling
from shardserve.messages import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from shardserve.config.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


class Scheduler(SchedulerResults):
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
        num_stages: int = 1, speculative_config: SpeculativeConfig | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.config = config
        self.num_stages = num_stages
        self._seq_cap = 1 << 30  # this step's most requests (see _micro_batch_cap)
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = make_request_queue(config.scheduling_policy)
        self.running: list[Request] = []
        # Requests the workers still hold state for and must be told to drop.
        self._finished_ids: set[str] = set()
        self.total_preemptions = 0
        self._structured: dict[str, int] = {}  # this step's SchedulerOutput.structured_positions
        # Requests ended outside a step (a grammar that failed): reported with the next outputs.
        self._ended_outside: list[EngineCoreOutput] = []
        self.spec = SpecDecodeScheduling(speculative_config)
        self._spec_tokens: dict[str, list[int]] = {}  # this step's scheduled drafts
        self._draft_slots: dict[str, int] = {}  # this step's drafts the workers fill in
        self.loras = LoRAAdmission(lora_config)  # which adapters may run together

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None and not request.status.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._ended_outside)

    def take_ended_outside(self) -> list[EngineCoreOutput]:
        """Outputs of requests that ended without a step (their grammar failed)."""
        ended, self._ended_outside = self._ended_outside, []
        return ended

    def compiling_grammars(self) -> list:
        """The compile futures of waiting requests whose grammar is not ready yet."""
        return [r.grammar.compiled for r in self.waiting
                if r.grammar is not None and not r.grammar.ready]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_tokens: dict[str, int] = {}
        cached = CachedRequestData()
        preempted: set[str] = set()
        self._seq_cap = self._micro_batch_cap()
        self._structured = {}
        self._spec_tokens = {}
        self._draft_slots = {}
        self.spec.begin_step(len(self.running))
        budget = self._schedule_running(budget, num_tokens, cached, preempted)
        new_reqs: list[NewRequestData] = []
        if not preempted:  # a full pool admits nobody new this step
            self._schedule_waiting(budget, num_tokens, new_reqs)
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_tokens,
            total_num_scheduled_tokens=sum(num_tokens.values()),
            finished_req_ids=finished - preempted,
            preempted_req_ids=preempted,
            structured_positions=self._structured,
            scheduled_spec_decode_tokens=self._spec_tokens,
            draft_slots=self._draft_slots,
        )

    def _schedule_running(
        self,
        budget: int,
        num_tokens: dict[str, int],
        cached: CachedRequestData,
        preempted: set[str],
    ) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(num_tokens) < self._seq_cap:
            request = self.running[i]
            n = min(self._num_new_tokens(request), budget)
            if n <= 0:  # everything it may compute is in flight already
                i += 1
                continue
            slotted = self._workers_place(request)
            drafts = [] if slotted else self._take_drafts(request, n, budget)
            k = self._take_slots(request, budget) if slotted else len(drafts)
            new_blocks = self.kv.allocate(request.request_id, request.num_computed_tokens + n + k)
            if new_blocks is None and k:  # drafts never cost a preemption: go without
                drafts, k = [], 0
                new_blocks = self.kv.allocate(request.request_id, request.num_computed_tokens + n)
            if new_blocks is None:
                # The last in the policy's order goes first (see request_queue.py). It sits at
                # index >= i, so it has not been scheduled in this step; if it is this request,
                # the loop ends.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                continue
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            if self.num_stages > 1:
                cached.new_token_ids.append(request.output_token_ids[request.num_output_tokens_sent:])
                request.num_output_tokens_sent = len(request.output_token_ids)
            if slotted:
                self._draft_slots[request.request_id] = k
            elif drafts:
                self._spec_tokens[request.request_id] = drafts
            num_tokens[request.request_id] = n + k
            self._advance(request, n, k)
            budget -= n + k
            i += 1
        return budget

    def _take_drafts(self, request: Request, n: int, budget: int) -> list[int]:
        """The drafts this decode verifies: only when its one known token is all it computes
        (a draft proposed while another step for it ran is stale), within the budget, the
        model's length and max_tokens (tokens past either would be dropped anyway)."""
        usable = n == 1 and request.num_computed_tokens == request.num_tokens - 1 \
            and not request.num_output_placeholders
        room = min(self.max_model_len - request.num_tokens,
                   request.max_output_tokens - len(request.output_token_ids)) - 1
        drafts = self.spec.take_drafts(request, usable, budget, room, len(self.running))
        # Usable drafts follow every folded token, so the matcher has taken them all.
        return request.grammar.valid_drafts(drafts) if request.grammar is not None else drafts

    def _workers_place(self, request: Request) -> bool:
        """Asynchronous speculative decoding: a request with a step in flight, which may
        verify drafts, runs its next step where the workers place it, with their own drafts
        (SchedulerOutput.draft_slots). Not with pipeline stages (they wait for the token) nor
        for a constrained request (its bitmask needs the drafts here: it waits, holds_back)."""
        return (self.spec.enabled and self.num_stages == 1 and request.grammar is None
                and request.num_output_placeholders > 0)

    def _take_slots(self, request: Request, budget: int) -> int:
        """How many drafts a step the workers place may verify: the gate's and the step's
        share, within the model's length and max_tokens however many tokens its step in
        flight emits (at most its drafts + 1, at least 1)."""
        request.spec_token_ids = []  # proposed before the step in flight: stale
        room = min(self.max_model_len - request.num_tokens - request.num_unverified_drafts,
                   request.max_output_tokens - len(request.output_token_ids)) - 2
        return self.spec.allowance(request, budget, room, len(self.running))

    def _num_new_tokens(self, request: Request) -> int:
        """Tokens a running request can compute now: known ones and in-flight placeholders
        not yet scheduled, unless the token in flight is already its last one."""
        placeholders = request.num_output_placeholders
        if placeholders and (self.num_stages > 1 or self.spec.holds_back(request)):
            return 0  # the stages (or its drafts) need its token back first
        if placeholders and (
            len(request.output_token_ids) + placeholders >= request.max_output_tokens
            or request.num_tokens + placeholders >= self.max_model_len
        ):
            return 0
        return request.num_tokens + placeholders - (
            request.num_computed_tokens - request.num_unverified_drafts)

    def _advance(self, request: Request, n: int, num_drafts: int = 0) -> None:
        """Count n scheduled tokens (and the drafts after them) as computed; a step that reaches
        the end samples one more (for a constrained request, noted with the index of the output
        token it samples). Drafts stay out of the known ids, so out of the prefix hashes."""
        request.num_computed_tokens += n + num_drafts
        request.num_unverified_drafts += num_drafts
        known = min(request.num_computed_tokens, request.num_tokens)  # ids known, KV scheduled
        if self.kv.enable_prefix_caching and \
                known // self.kv.block_size > self.kv.num_registered(request.request_id):
            self.kv.register_full_blocks(request.request_id, request.all_token_ids, known,
                                         request.lora_key)
        if request.num_computed_tokens - request.num_unverified_drafts == \
                request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1
            if request.grammar is not None:
                self._structured[request.request_id] = (
                    len(request.output_token_ids) + request.num_output_placeholders - 1)

    def _schedule_waiting(
        self, budget: int, num_tokens: dict[str, int], new_reqs: list[NewRequestData]
    ) -> None:
        # Passed over this step: their grammar is not ready, or their adapter has no slot.
        passed: list[Request] = []
        self.loras.start(self.running)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(num_tokens) < self._seq_cap
        ):
            request = self.waiting.peek()
            if request.grammar is not None and not request.grammar.ready or \
                    not self.loras.fits(request):
                why = self.loras.never_fits(request)
                if why is None:
                    passed.append(self.waiting.pop())
                else:
                    self._end_outside(request, why)
                continue
            if request.grammar is not None and request.grammar.failed:
                self._end_outside(request, request.grammar.failed)
                continue
            if request.num_output_placeholders:
                break  # preempted with a token in flight: resume once that token is known
            prefix = self._cached_prefix(request)
            start = max(request.num_computed_tokens, len(prefix) * self.kv.block_size)
            remaining = request.num_tokens - start
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            if self.kv.allocate(request.request_id, start + n, prefix) is None:
                break
            if self._may_use_cache(request):
                self.kv.count_lookup(request.num_tokens, len(prefix) * self.kv.block_size)
            if prefix:
                request.num_computed_tokens = start
                request.num_cached_tokens = max(request.num_cached_tokens, start)
            self.waiting.pop()
            request.num_output_tokens_sent = len(request.output_token_ids)
            request.status = RequestStatus.RUNNING
            self.waiting.place_running(self.running, request)
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=list(self.kv.block_ids(request.request_id)),
                    num_computed_tokens=request.num_computed_tokens,
                    output_token_ids=list(request.output_token_ids),
                    lora_request=request.lora_request,
                )
            )
            self.loras.admitted(request)
            num_tokens[request.request_id] = n
            self._advance(request, n)
            budget -= n
        self.waiting.put_back(passed)

    def _cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks for a request that holds none yet (new, or preempted), leaving at
        least its last token to compute. Prompt logprobs need every prompt position computed,
        so such a request takes none."""
        if not self._may_use_cache(request):
            return []
        return self.kv.cached_prefix(request.all_token_ids, request.num_tokens - 1,
                                     request.lora_key)

    def _may_use_cache(self, request: Request) -> bool:
        pooling = request.sampling_params.pooling  # MEAN and CLS pool every position
        return (self.kv.enable_prefix_caching and not request.num_computed_tokens
                and request.sampling_params.prompt_logprobs is None
                and not (pooling is not None and pooling.needs_every_position))

    def _end_outside(self, request: Request, why: str) -> None:
        logger.error("request %s: %s; it ends (finish_reason abort)", request.request_id, why)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._ended_outside.append(EngineCoreOutput(request.request_id, [], "abort"))

    def _micro_batch_cap(self) -> int:
        """Most requests this step may take: with pipeline stages, an even share of the
        unfinished ones, so that every stage gets a micro-batch; else no cap. (One micro-batch
        more than stages, so that a stage has work while the engine turns one around, measured
        slower: 0.79x TP=2 against 0.89x, batch 64 on 2 cores.)"""
        if self.num_stages == 1:
            return 1 << 30
        unfinished = len(self.running) + len(self.waiting)
        return max(1, -(-unfinished // self.num_stages))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_unverified_drafts = 0  # (its steps in flight roll nothing back)
        request.spec_token_ids = []  # proposed for positions it will recompute
        request.num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.put_back([request])

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        self.spec.finish(request.request_id)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]
