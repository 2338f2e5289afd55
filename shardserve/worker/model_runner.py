"""ModelRunner: turns scheduler deltas into model inputs, runs the model, samples.

It keeps each running request's state between steps (its tokens, block table and progress), so
the scheduler only sends what changed. Every rank runs the same code on the same inputs and samples
with identically seeded generators, so tensor-parallel ranks stay in step without exchanging the
sampled tokens; only the output rank's reply is used.

Pipeline stages: each rank holds its stage's layers and KV cache only. A stage after the first
receives the previous stage's (hidden, residual) pair, a stage before the last hands its own on;
only the last stage computes logits and samples. Stages never see each other's sampled tokens,
so with pipeline parallelism every rank takes each request's new tokens from the scheduler
(`CachedRequestData.new_token_ids`) and none appends what it sampled itself.

Speculative decoding (spec_verify.py): a request may run its last token and drafts as 1 + d
positions, sampled as 1 + d rows and verified; it keeps the accepted drafts and one more token,
and the output rank proposes its next drafts. With asynchronous scheduling every rank of the
(single) stage proposes, and a step planned while the request's previous one ran fills its
draft slots with this rank's own proposal, at this rank's own positions (the scheduler cannot
know how many drafts that step accepted; engine/spec_decode_scheduling.py).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from shardserve.config import EngineConfig, KVCacheConfig
from shardserve.distributed.parallel_state import (
    get_dcp_group,
    get_pcp_group,
    get_pp_group,
    get_tp_group,
)
from shardserve.messages import (
    GrammarOutput,
    ModelRunnerOutput,
    PromptLogprobs,
    SchedulerOutput,
)
from shardserve.model import native_kernels
from shardserve.model.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    kv_cache_bytes_per_block,
)
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.loader import iter_weights
from shardserve.model.sampler import RequestSamplingState, gather_logprobs
from shardserve.worker.context_parallel_inputs import ContextParallel, Rows
from shardserve.worker.lora_worker import WorkerLoRAs
from shardserve.worker.pooler import RequestPooler
from shardserve.worker.request_state import CachedRequestState, PendingSample
from shardserve.worker.spec_verify import Drafter, verify_rows
from shardserve.worker.step_sampler import StepSampler


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.arch = config.model_config.arch
        self.dtype = config.model_config.torch_dtype
        self.kv_dtype = config.kv_cache_torch_dtype
        self.block_size = config.cache_config.block_size
        self.model: LlamaForCausalLM | None = None
        self.kv_caches: list[torch.Tensor] | None = None
        self.kv_cache_config: KVCacheConfig | None = None
        self.requests: dict[str, CachedRequestState] = {}
        self.pooler = RequestPooler()  # runner="pooling": see pooler.py
        self._pending: PendingSample | None = None
        self.tokens_from_scheduler = config.parallel_config.pipeline_parallel_size > 1
        self.step_sampler = StepSampler(self.arch.vocab_size, self.arch.eos_token_ids, device,
                                        config.model_config.seed, self.tokens_from_scheduler)
        # Ray compiled graph: hidden states cross stages as the graph's node values instead of
        # through the PipelineGroup (set by the caller before each step).
        self.graph_handoff = False
        self.inbound: tuple[torch.Tensor, torch.Tensor] | None = None
        self._outbound: tuple[torch.Tensor, torch.Tensor] | None = None
        # Idle gaps: from the end of one step (its sampling) to the start of the next step's
        # execute_model, in seconds. How long the model waited for the engine.
        self.idle_gaps: deque[float] = deque(maxlen=100_000)
        self._last_step_end: float | None = None
        self.drafter: Drafter | None = None  # built in load_model, on the output rank only
        self.cp: ContextParallel | None = None  # context parallelism, built in load_model
        self.loras = WorkerLoRAs(config.lora_config, self.dtype) \
            if config.lora_config is not None else None  # enable_lora: see lora_worker.py

    # ---- setup ----
    def load_model(self) -> None:
        if self.device.type == "cpu":  # built now: logs its ISA level, refuses a bad SHARDSERVE_ISA
            native_kernels.library()
        layers = self.config.parallel_config.stage_layers(
            get_pp_group().stage, self.arch.num_layers
        )
        quantization = self.config.model_config.quantization
        model = LlamaForCausalLM(self.arch, self.dtype, self.device, layers, quantization)
        model.load_weights(iter_weights(self.config.model_config.path,
                                        keep_quantized=quantization == "gguf"))
        self.model = model.eval()
        self.cp = ContextParallel.build(self.config, get_tp_group(), get_pcp_group(),
                                        get_dcp_group(), self.device)
        if self.loras is not None:
            self.loras.attach(self.model)
        if self.config.speculative_config is not None and self._proposes() \
                and self.drafter is None:
            self.drafter = Drafter(self.config.speculative_config,
                                   self.config.model_config.max_model_len)
            self.step_sampler.drafter = self.drafter

    def _proposes(self) -> bool:
        """Whether this rank proposes drafts: the one whose reply the engine reads (the first
        of the last stage), or under external_launcher every rank of the last stage (each
        rank's engine reads its own worker's reply; the proposals agree, as the samples do), or
        with asynchronous scheduling and one stage every rank (each fills its own draft slots)."""
        if not get_pp_group().is_last:
            return False
        pc = self.config.parallel_config
        return get_tp_group().rank == 0 or pc.distributed_executor_backend == "external_launcher" \
            or self.config.scheduler_config.async_scheduling and pc.pipeline_parallel_size == 1

    def kv_cache_block_bytes(self) -> int:
        model = self._require_model()
        return kv_cache_bytes_per_block(
            model.num_layers, self.block_size, self._cache_kv_heads(), model.head_dim,
            self.kv_dtype,
        )

    def _cache_kv_heads(self) -> int:
        """KV heads of this rank's cache: its own, or with DCP every head of its group."""
        model = self._require_model()
        local = model.local_num_kv_heads
        return local if self.cp is None else self.cp.cache_kv_heads(local)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        model = self._require_model()
        self.kv_cache_config = kv_cache_config
        self.kv_caches = allocate_kv_cache(
            model.num_layers,
            kv_cache_config.num_blocks,
            kv_cache_config.block_size,
            self._cache_kv_heads(),
            model.head_dim,
            self.kv_dtype,
            self.device,
        )

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One small forward so that first-call costs (allocator, kernels) are paid now."""
        n = min(self.block_size, 8)
        meta = AttentionMetadata.build([n], [n], [[0]], self.block_size, self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        model = self._require_model()
        # A later stage runs on zeros instead of receiving: warm-up is no collective.
        pair = None if model.is_first else tuple(
            torch.zeros(n, self.arch.hidden_size, dtype=self.dtype, device=self.device)
            for _ in range(2)
        )
        # Its own small cache: a DCP rank's holds its group's heads, not the layers' own.
        cache = allocate_kv_cache(model.num_layers, 1, self.block_size, model.local_num_kv_heads,
                                  model.head_dim, self.kv_dtype, self.device)
        hidden = model(ids, meta, cache, pair)
        if model.is_last:
            model.compute_logits(hidden[meta.logits_indices])

    def free_kv_cache(self) -> None:
        self.kv_caches = None

    def free_model(self) -> None:
        self.model = None
        if self.loras is not None:
            self.loras.detach()  # its slots are the model's tensors

    # ---- one step ----
    def update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None and self.drafter is not None:
                self.drafter.finish(rid, state.sampling.output_token_ids)
            self.pooler.drop(rid)
        for new in so.scheduled_new_reqs:
            if self.drafter is not None:
                self.drafter.start(new.req_id, new.prompt_token_ids)
            sampling = RequestSamplingState(
                params=new.sampling_params,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids),
            )
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, sampling, list(new.block_ids), new.num_computed_tokens,
                new.lora_request,
            )
        cached = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.requests[rid]
            state.block_ids.extend(blocks)
            if rid not in so.draft_slots:  # else an upper bound: its own count is exact
                state.num_computed_tokens = computed
        if self.tokens_from_scheduler:
            for rid, tokens in zip(cached.req_ids, cached.new_token_ids, strict=True):
                self.requests[rid].sampling.output_token_ids.extend(tokens)

    def reset_idle_gaps(self) -> None:
        self.idle_gaps.clear()
        self._last_step_end = None

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        if self._last_step_end is not None and so.total_num_scheduled_tokens:
            self.idle_gaps.append(time.perf_counter() - self._last_step_end)
        self.update_states(so)
        self._pending = None
        if so.total_num_scheduled_tokens == 0:
            return
        order = so.scheduled_cached_reqs.req_ids + [r.req_id for r in so.scheduled_new_reqs]
        states = [self.requests[rid] for rid in order]
        query_lens = [so.num_scheduled_tokens[rid] for rid in order]
        spec = so.scheduled_spec_decode_tokens or so.draft_slots
        drafts = self._drafts(so, order, states, query_lens) if spec else [[]] * len(order)
        input_ids, rows = self._prepare_inputs(states, query_lens, drafts)
        meta = self._metadata(rows)
        if self.loras is not None:  # every token's adapter slot, for this step's layers
            self.loras.prepare([s.lora_request for s in states], query_lens)
        if self.cp is None:
            hidden = self._forward(input_ids, meta)
        else:
            hidden = self.cp.forward(self._forward, input_ids, meta, rows)
        if hidden is None:  # not the last stage: nothing to sample here
            for s, n in zip(states, query_lens, strict=True):
                s.num_computed_tokens += n
            return
        prompt_logprobs = self._prompt_logprobs(states, query_lens, hidden)
        specs = [s.sampling.params.pooling for s in states]
        pooled = self.pooler.pool(states, specs, query_lens, hidden) if any(specs) else None
        # Only requests whose every token (and draft) is now computed get a new token (not
        # mid-prefill ones); a pooling request samples nothing.
        rows = [
            i
            for i, (s, n) in enumerate(zip(states, query_lens, strict=True))
            if s.num_computed_tokens + n == s.num_tokens + len(drafts[i]) and specs[i] is None
        ]
        for s, n in zip(states, query_lens, strict=True):
            s.num_computed_tokens += n
        row_drafts = [drafts[i] for i in rows] if any(drafts) else None
        logits = self._logits(hidden, meta, rows, query_lens, row_drafts) if rows else None
        if rows or prompt_logprobs or pooled:
            self._pending = PendingSample([states[i] for i in rows], logits, prompt_logprobs,
                                           pooled, row_drafts)

    @staticmethod
    def _drafts(so: SchedulerOutput, order: list[str], states: list[CachedRequestState],
                query_lens: list[int]) -> list[list[int]]:
        """Each request's drafts this step: those scheduled, or its own proposal in the slots
        (its query then 1 + the drafts taken, fewer than scheduled where it had fewer)."""
        drafts = []
        for i, rid in enumerate(order):
            slots = so.draft_slots.get(rid)
            if slots is None:
                drafts.append(so.scheduled_spec_decode_tokens.get(rid, []))
                continue
            drafts.append(states[i].next_drafts[:slots])
            query_lens[i] = 1 + len(drafts[-1])
        return drafts

    def _logits(self, hidden: torch.Tensor, meta: AttentionMetadata, rows: list[int],
                query_lens: list[int], row_drafts: list[list[int]] | None) -> torch.Tensor:
        """The logits of the sampling requests `rows`: each one's last position, or with
        drafts each verifying request's last 1 + d positions (rows of the flat batch: a
        verify step's attention rows are not one a request, see _prepare_inputs)."""
        if row_drafts is None and len(rows) == meta.num_tokens == hidden.shape[0]:
            return self._require_model().compute_logits(hidden)  # a token per row, each samples
        if row_drafts is None:
            idx = meta.logits_indices[torch.tensor(rows, dtype=torch.long)]
        else:
            last = np.cumsum(query_lens) - 1
            idx = torch.tensor(verify_rows([int(last[i]) for i in rows], row_drafts),
                               dtype=torch.long)
        return self._require_model().compute_logits(hidden[idx])

    def _prompt_logprobs(self, states: list[CachedRequestState], query_lens: list[int],
                         hidden: torch.Tensor) -> dict[str, PromptLogprobs]:
        """From this step's hidden states, no second pass: for each request that asked, the
        logprobs of the prompt tokens its chunk predicts (position p predicts token p + 1)."""
        out: dict[str, PromptLogprobs] = {}
        offset = 0
        for s, n in zip(states, query_lens, strict=True):
            num_top = s.sampling.params.prompt_logprobs
            start, prompt = s.num_computed_tokens, s.sampling.prompt_token_ids
            end = min(start + n, len(prompt) - 1)  # the last prompt position predicts output
            if num_top is not None and end > start:
                logits = self._require_model().compute_logits(hidden[offset:offset + end - start])
                targets = torch.tensor(prompt[start + 1:end + 1], dtype=torch.long,
                                       device=logits.device)
                ids, values, ranks = gather_logprobs(logits.log_softmax(dim=-1), targets, num_top)
                out[s.req_id] = PromptLogprobs(start, ids.cpu().numpy(), values.cpu().numpy(),
                                               ranks.cpu().numpy())
            offset += n
        return out

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """This stage's part of the forward pass: final hidden states on the last stage, else
        None after handing the (hidden, residual) pair to the next stage."""
        model, pp = self._require_model(), get_pp_group()
        pair = None
        if not pp.is_first:
            if self.graph_handoff:
                pair, self.inbound = self.inbound, None
            else:
                shape = (input_ids.shape[0], self.arch.hidden_size)
                hidden, residual = pp.recv([shape, shape], self.dtype, self.device)
                pair = (hidden, residual)
        out = model(input_ids, meta, self._require_kv(), pair)
        if pp.is_last:
            assert isinstance(out, torch.Tensor)
            return out
        if self.graph_handoff:
            self._outbound = out
        else:
            pp.send(list(out))
        return None

    def take_outbound(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pair this (non-last) stage produced in the last step, for the caller to hand on
        (graph hand-off; None when the step had no tokens)."""
        out, self._outbound = self._outbound, None
        return out

    def _metadata(self, rows: Rows) -> AttentionMetadata:
        """The full step's metadata (with DCP its block tables count virtual blocks)."""
        return AttentionMetadata.build(rows.query_lens, rows.seq_lens, rows.block_tables,
                                       self.config.virtual_block_size, self.device)

    def _prepare_inputs(
        self, states: list[CachedRequestState], query_lens: list[int], drafts: list[list[int]]
    ) -> tuple[torch.Tensor, Rows]:
        """A request's query: its scheduled known tokens, then the drafts it verifies.

        A verifying request's positions go to attention as decode rows, each over the context
        up to itself: every row's K/V is written before any row attends (in the layer-by-layer
        path and in the fused one alike), so that is causal attention, and a verify step of
        1 + d positions runs the decode kernels (fused, up to the row kernels' rows_max) as d + 1
        decodes would, bit for bit."""
        tokens: list[int] = []
        rows_q: list[int] = []
        rows_seq: list[int] = []
        rows_blocks: list[list[int]] = []
        for s, n, d in zip(states, query_lens, drafts, strict=True):
            start = s.num_computed_tokens
            tokens.extend(s.token_ids(start, start + n - len(d)))
            tokens.extend(d)
            if d and n == len(d) + 1:
                rows_q += [1] * n
                rows_seq += range(start + 1, start + n + 1)
                rows_blocks += [s.block_ids] * n
            else:
                rows_q.append(n)
                rows_seq.append(start + n)
                rows_blocks.append(s.block_ids)
        input_ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(self.device)
        return input_ids, Rows(rows_q, rows_seq, rows_blocks)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        pending, self._pending = self._pending, None
        try:
            if pending is None:
                return ModelRunnerOutput.empty()
            if pending.logits is None:
                out = ModelRunnerOutput.empty()
            else:
                out = self.step_sampler.sample(pending, grammar_output, len(self.requests))
            out.prompt_logprobs = pending.prompt_logprobs or None
            out.pooler_output = pending.pooled or None
            return out
        finally:
            self._last_step_end = time.perf_counter()

    def _require_model(self) -> LlamaForCausalLM:
        if self.model is None:
            raise RuntimeError("the model is not loaded (call load_model, or wake_up after sleep)")
        return self.model

    def _require_kv(self) -> list[torch.Tensor]:
        if self.kv_caches is None:
            raise RuntimeError(
                "the KV cache is not allocated "
                "(call initialize_from_config, or wake_up after sleep)"
            )
        return self.kv_caches
