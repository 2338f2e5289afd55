"""The workers' side of speculative decoding: a verify step's logits rows and sampling states,
the tokens each request keeps, and the drafts the output rank proposes after sampling.

A request verifying d drafts (SchedulerOutput.scheduled_spec_decode_tokens) runs its last
sampled token and the drafts as 1 + d query positions; position j's logits predict the token
after drafts[:j]. Each position is sampled as its own row, with a sampling state whose output
is the request's output plus drafts[:j]: penalties, min_tokens, bad words, logits controls and
the per-position seed then see exactly the context they would see without speculation, had the
drafts before it been sampled. model/rejection_sampler.py decides what is kept.

The output rank proposes (the rank whose reply the engine reads); the others get the drafts
with the next step's SchedulerOutput like every other input. With asynchronous scheduling (one
pipeline stage) every rank proposes, for the steps whose drafts the workers fill in themselves
(SchedulerOutput.draft_slots): each rank's proposals agree, as its samples do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shardserve.model import rejection_sampler
from shardserve.model.sampler import RequestSamplingState

if TYPE_CHECKING:
    from shardserve.config.speculative import SpeculativeConfig


def verify_rows(last_rows: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[int]:
    """Flat-batch rows whose logits a step needs: each sampling request's last len(drafts) + 1
    rows (`last_rows`: its last row)."""
    rows: list[int] = []
    for last, d in zip(last_rows, drafts, strict=True):
        rows.extend(range(last - len(d), last + 1))
    return rows


def position_states(states: Sequence[RequestSamplingState],
                    drafts: Sequence[Sequence[int]]) -> list[RequestSamplingState]:
    """One sampling state per logits row: position j of a request sees drafts[:j] as output."""
    out: list[RequestSamplingState] = []
    for state, d in zip(states, drafts, strict=True):
        out.append(state)
        for j in range(1, len(d) + 1):
            out.append(RequestSamplingState(state.params, state.prompt_token_ids,
                                            state.output_token_ids + list(d[:j])))
    return out


@dataclass
class Verified:
    """What a verify step keeps: the emitted tokens back to back, the logits rows they were
    drawn at (for their logprobs), and how many each request emitted."""

    token_ids: list[int]
    rows: list[int]
    num_sampled: list[int]


def keep_verified(drawn: Sequence[int], drafts: Sequence[Sequence[int]]) -> Verified:
    """Apply the acceptance rule to each request's rows of `drawn` (one draw a logits row)."""
    kept = Verified([], [], [])
    row = 0
    for d in drafts:
        tokens = rejection_sampler.verify(drawn[row:row + len(d) + 1], d)
        kept.token_ids.extend(tokens)
        kept.rows.extend(range(row, row + len(tokens)))
        kept.num_sampled.append(len(tokens))
        row += len(d) + 1
    return kept


class _Tokens:
    """A request's prompt + output as a growing int64 array (amortized O(1) a token): the
    proposers search numpy arrays, and a Python list of thousands of ids costs tens of
    microseconds to convert on every step."""

    def __init__(self, prompt: list[int]) -> None:
        self.data = np.empty(max(64, 2 * len(prompt)), dtype=np.int64)
        self.size = len(prompt)
        self.data[:self.size] = prompt
        self.num_prompt = len(prompt)

    def sync(self, output: list[int], extra: list[int]) -> np.ndarray:
        """The tokens for output + extra (output only ever grows; extra: tokens emitted this
        step that the state does not hold yet)."""
        new = output[self.size - self.num_prompt:] + extra
        if self.size + len(new) > len(self.data):
            grown = np.empty(2 * (self.size + len(new)), dtype=np.int64)
            grown[:self.size] = self.data[:self.size]
            self.data = grown
        self.data[self.size:self.size + len(new)] = new
        view = self.data[:self.size + len(new)]
        self.size = self.num_prompt + len(output)  # extra is written again once the state has it
        return view


class Drafter:
    """The output rank's proposer (worker/spec_decode/), fed each request's tokens after
    every step that sampled for it."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        from shardserve.worker.spec_decode import build_proposer

        self.proposer = build_proposer(config)
        self.k = config.num_speculative_tokens
        self.max_batch = config.max_batch_for_speculation
        self.max_model_len = max_model_len
        self._tokens: dict[str, _Tokens] = {}

    def start(self, req_id: str, prompt_token_ids: list[int]) -> None:
        self.proposer.start(req_id, prompt_token_ids)
        self._tokens[req_id] = _Tokens(prompt_token_ids)

    def finish(self, req_id: str, output_token_ids: list[int] | None = None) -> None:
        """Forget the request. A proposer that learns from every token (the suffix index)
        first takes the output it did not see (steps above the batch limit, where it was not
        called), so that the whole output reaches its global store."""
        tokens = self._tokens.pop(req_id, None)
        if tokens is not None and output_token_ids and self.proposer.learns_from_every_token:
            self.proposer.propose(req_id, tokens.sync(output_token_ids, []), 0)
        self.proposer.finish(req_id)

    def propose(self, states: Sequence[tuple[str, RequestSamplingState, list[int]]],
                num_running: int) -> dict[str, list[int]]:
        """Drafts for each (request, its sampling state, tokens emitted this step that the
        state does not hold yet), capped so that every draft plus the bonus token stays within
        max_model_len and max_tokens. None at all above the batch limit. A proposer that
        learns from every token (the suffix index) takes the tokens it missed at its next call
        (or at finish): above the limit a step costs it nothing."""
        from shardserve.worker.spec_decode.ngram import cap_draft_len

        if num_running > self.max_batch:
            return {}
        learns = self.proposer.learns_from_every_token
        drafts: dict[str, list[int]] = {}
        for req_id, state, extra in states:
            if req_id not in self._tokens:
                self.start(req_id, state.prompt_token_ids)
            tokens = self._tokens[req_id].sync(state.output_token_ids, extra)
            num_output = len(state.output_token_ids) + len(extra)
            max_tokens = state.params.max_tokens or 1 << 30
            k = cap_draft_len(self.k, len(tokens), self.max_model_len, max_tokens - num_output)
            draft = self.proposer.propose(req_id, tokens, k) if k > 0 or learns else []
            if draft:
                drafts[req_id] = list(draft[:k])
        return drafts
