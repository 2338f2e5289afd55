"""The sampling half of a step: a step's logits to tokens (sampler.py), verified against the
drafts a request verifies (spec_verify.py, model/rejection_sampler.py), the grammar's mask
applied first, the tokens taken into each request's state, and the output rank's next drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shardserve.messages import GrammarOutput, ModelRunnerOutput
from shardserve.model.logits_controls import apply_token_bitmask_
from shardserve.model.sampler import Sampler, SamplingMetadata
from shardserve.worker.request_state import PendingSample
from shardserve.worker.spec_verify import Drafter, keep_verified, position_states


class StepSampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device,
                 seed: int, tokens_from_scheduler: bool) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.sampler = Sampler()
        self.generator = torch.Generator().manual_seed(seed)
        # Pipeline stages: the scheduler sends each request's tokens (model_runner.py).
        self.tokens_from_scheduler = tokens_from_scheduler
        self.drafter: Drafter | None = None  # the output rank's, with speculative decoding

    def sample(self, pending: PendingSample, grammar_output: GrammarOutput | None,
               num_requests: int) -> ModelRunnerOutput:
        """The step's tokens (verified where it had drafts), taken into the request states,
        and the next drafts (`num_requests`: the requests the runner holds)."""
        sampling = [s.sampling for s in pending.states]
        drafts = pending.drafts
        meta = SamplingMetadata.build(
            sampling if drafts is None else position_states(sampling, drafts),
            self.vocab_size,
            self.eos_token_ids,
            device=self.device,
            generator=self.generator,
        )
        if grammar_output is not None:
            self._apply_grammar(pending, grammar_output)
        out = self.sampler(pending.logits, meta)
        sampled = out.sampled_token_ids.cpu().numpy()
        logprobs = (out.logprob_token_ids, out.logprobs, out.sampled_token_ranks)
        num_sampled = None
        if drafts is not None:
            sampled, num_sampled, logprobs = _verified(sampled, drafts, logprobs)
        emitted = _split(sampled.tolist(), num_sampled)
        self._keep(pending, emitted)
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in pending.states],
            sampled_token_ids=sampled,
            num_sampled=None if num_sampled is None else np.asarray(num_sampled, np.int64),
            logprob_token_ids=_to_numpy(logprobs[0]),
            logprobs=_to_numpy(logprobs[1]),
            sampled_token_ranks=_to_numpy(logprobs[2]),
            draft_token_ids=self._propose(pending, emitted, num_requests),
            num_drafts=None if drafts is None else np.asarray([len(d) for d in drafts],
                                                               np.int64),
        )

    def _keep(self, pending: PendingSample, emitted: list[list[int]]) -> None:
        """Each request takes its emitted tokens (unless the scheduler sends them: stages) and
        forgets the positions of its rejected drafts (their KV is overwritten later)."""
        for i, (s, tokens) in enumerate(zip(pending.states, emitted, strict=True)):
            if not self.tokens_from_scheduler:
                s.sampling.output_token_ids.extend(tokens)
            if pending.drafts is not None:
                s.num_computed_tokens -= len(pending.drafts[i]) + 1 - len(tokens)

    def _propose(self, pending: PendingSample, emitted: list[list[int]],
                 num_requests: int) -> dict[str, list[int]] | None:
        """The output rank's drafts for the next step of each request that sampled."""
        if self.drafter is None:
            return None
        extra = emitted if self.tokens_from_scheduler else [[]] * len(emitted)
        drafts = self.drafter.propose(
            [(s.req_id, s.sampling, e) for s, e in zip(pending.states, extra, strict=True)],
            num_requests)
        for s in pending.states:  # for a next step with draft slots
            s.next_drafts = drafts.get(s.req_id, [])
        return drafts or None

    @staticmethod
    def _apply_grammar(pending: PendingSample, grammar_output: GrammarOutput) -> None:
        """Mask the constrained rows in place (vLLM does the same before its sampler, so
        logprobs of a constrained request come from the masked distribution). A request
        verifying drafts has one bitmask row per position, in order (its id repeated)."""
        first_row, row = {}, 0
        for i, s in enumerate(pending.states):
            first_row[s.req_id] = row
            row += 1 + (len(pending.drafts[i]) if pending.drafts is not None else 0)
        seen: dict[str, int] = {}
        pairs = []
        for r, rid in enumerate(grammar_output.req_ids):
            if rid in first_row:
                j = seen[rid] = seen.get(rid, -1) + 1
                pairs.append((first_row[rid] + j, r))
        if pairs:
            rows, bitmask_rows = zip(*pairs, strict=True)
            apply_token_bitmask_(pending.logits, list(rows),
                                 grammar_output.token_bitmask[list(bitmask_rows)])


def _verified(sampled: np.ndarray, drafts: list[list[int]], logprobs: tuple
              ) -> tuple[np.ndarray, list[int], tuple]:
    """What a verify step keeps of its rows' draws: each request's emitted tokens, how many,
    and the logprobs rows they were drawn at."""
    kept = keep_verified(sampled.tolist(), drafts)
    if logprobs[0] is not None:
        rows = torch.tensor(kept.rows, dtype=torch.long)
        logprobs = tuple(t[rows] for t in logprobs)
    return np.asarray(kept.token_ids, dtype=np.int64), kept.num_sampled, logprobs


def _to_numpy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.cpu().numpy()


def _split(tokens: list[int], counts: list[int] | None) -> list[list[int]]:
    """Flat tokens as one list a request (`counts`: how many each; None: one each)."""
    if counts is None:
        return [[t] for t in tokens]
    out, start = [], 0
    for n in counts:
        out.append(tokens[start:start + n])
        start += n
    return out
