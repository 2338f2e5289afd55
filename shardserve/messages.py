"""Messages that cross the engine → executor → worker boundary (pickled, broadcast to every rank).

Size budget: a decode step for B running requests costs O(B) small ints, never the requests' full
token lists. New requests travel in full once; afterwards only deltas (new block ids, the count of
computed tokens) are sent. Workers keep the rest of each request's state (model_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen, or one resumed after preemption (sent in full)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens generated before a preemption: recomputed with the prompt, and needed by penalties and
    # by per-position seeding, so that a resumed request continues exactly as it would have.
    output_token_ids: list[int] = field(default_factory=list)
    # The adapter the request runs with: a shardserve.lora.request.LoRARequest (typed Any:
    # this leaf module may not import the lora package above it), None for the base model.
    # Every rank can load it from its lora_path, so a worker that evicted it serves it still.
    lora_request: Any = None


@dataclass
class CachedRequestData:
    """Requests the workers already hold: parallel lists, one entry per request."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Pipeline parallelism only: output tokens each request gained since the workers last saw
    # it (stages do not see each other's samples, so the scheduler tells them all).
    new_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's work. Requests run in the order: cached requests, then new ones."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the workers must forget (finished, aborted, or preempted: a preempted request comes
    # back later as a NewRequestData).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Constrained requests that sample this step → the index of the output token they sample.
    structured_positions: dict[str, int] = field(default_factory=dict)
    # Set by the engine core: the step's grammar bitmask comes later, with sample_tokens (an
    # earlier step's tokens are still sampling); a backend may start the forward pass now.
    grammar_pending: bool = False
    # Speculative decoding: request → the draft tokens it verifies this step. They follow its
    # scheduled tokens (num_scheduled_tokens counts them) and are no part of its token ids: the
    # workers compute logits at each of its 1 + len(drafts) last positions, and keep in their
    # state only the drafts the step accepts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Asynchronous speculative decoding: request → at most how many drafts it verifies this
    # step, which the workers take from their own proposals after its step still in flight.
    # That step's accepted count is not known here, so the workers place the request
    # themselves: its last sampled token at their own num_computed_tokens (the one sent is an
    # upper bound), then up to that many drafts. num_scheduled_tokens counts 1 + the slots.
    draft_slots: dict[str, int] = field(default_factory=dict)


@dataclass
class GrammarOutput:
    """The allowed tokens of the step's constrained requests, packed 32 to an int32:

        token_bitmask[i, t // 32] >> (t % 32) & 1 == 1  ⇔  req_ids[i] may sample token t

    int32 [len(req_ids), ceil(vocab_size / 32)], little-endian bit order (xgrammar's layout):
    6 KiB a request for a 49,152-token vocabulary, against 48 KiB as bools."""

    req_ids: list[str]
    token_bitmask: np.ndarray


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens start+1 .. start+len (each given the tokens before it): per
    position the actual token first, then the top-N, as ModelRunnerOutput's logprobs."""

    start: int  # the prompt position whose logits predict the first entry's token
    token_ids: np.ndarray  # int64 [len, 1 + N]
    logprobs: np.ndarray  # float32 [len, 1 + N]
    ranks: np.ndarray  # int64 [len]: the actual token's rank


@dataclass
class ModelRunnerOutput:
    """The tokens sampled this step, for the requests whose prefill is complete."""

    req_ids: list[str]
    # int64 [T]: each request's tokens, back to back in req_ids' order (T = N without drafts).
    sampled_token_ids: np.ndarray
    # Speculative decoding: tokens each request emitted this step, int64 [N] aligned with
    # req_ids (the accepted drafts, then the token sampled at the first rejection, or the bonus
    # token after the last draft); None: one each.
    num_sampled: np.ndarray | None = None
    # With logprobs requested: [T, 1 + max_logprobs], the sampled token's entry first, then top-N.
    logprob_token_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    sampled_token_ranks: np.ndarray | None = None
    # Requests that asked for prompt logprobs and computed prompt tokens this step (a prefill
    # chunk, maybe without a sample) → PromptLogprobs of the positions the chunk covered.
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    # Pooling requests (runner="pooling") whose prompt completed this step -> the pooled
    # hidden state, float32 [hidden_size] (normalized when asked). They sample nothing, so
    # they are not in req_ids. Computed on the last pipeline stage, sent by the output rank.
    pooler_output: dict[str, np.ndarray] | None = None
    # Speculative decoding: the output rank's drafts for each request's next step (a request
    # without a proposal is absent).
    draft_token_ids: dict[str, list[int]] | None = None
    # Speculative decoding: the drafts each request verified this step, int64 [N] aligned
    # with req_ids (fewer than its draft_slots where the proposer had fewer); None: no drafts.
    num_drafts: np.ndarray | None = None

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls(req_ids=[], sampled_token_ids=np.zeros(0, dtype=np.int64))

    def token_offsets(self) -> list[int]:
        """Where each request's tokens start in sampled_token_ids, plus the end: request j has
        rows offsets[j]:offsets[j + 1] (of the logprobs arrays too)."""
        if self.num_sampled is None:
            return list(range(len(self.req_ids) + 1))
        return [0, *np.cumsum(self.num_sampled).tolist()]


@dataclass
class EngineCoreOutput:
    """What the engine core reports for one request after a step (the front end detokenizes)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    # One entry per new token: {token_id: (logprob, rank)}, the sampled token plus the top-N.
    new_logprobs: list[dict[int, tuple[float, int]]] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    # A pooling request's result (it ends with this output): float32 [hidden_size].
    pooled: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
