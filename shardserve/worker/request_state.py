"""What the model runner keeps of each request between steps, and what a step's forward pass
leaves for its sampling (model_runner.py, step_sampler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shardserve.lora.request import LoRARequest
from shardserve.messages import PromptLogprobs
from shardserve.model.sampler import RequestSamplingState


@dataclass
class CachedRequestState:
    req_id: str
    sampling: RequestSamplingState  # owns the prompt and output token lists
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model
    # This rank's proposal after the request's last step that sampled, for a next step whose
    # drafts the workers fill in (SchedulerOutput.draft_slots).
    next_drafts: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.sampling.prompt_token_ids) + len(self.sampling.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole history."""
        prompt, output = self.sampling.prompt_token_ids, self.sampling.output_token_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return output[start - n : end - n]
        return prompt[start:] + output[: end - n]


@dataclass
class PendingSample:
    """What execute_model leaves for sample_tokens: the rows that need a token."""

    states: list[CachedRequestState]
    logits: torch.Tensor | None  # None when no request samples (prompt logprobs only)
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    pooled: dict[str, np.ndarray] | None = None  # pooling requests done this step
    # Aligned with states: the drafts each verifies (its logits hold 1 + len rows), or None
    # when no request of the step has any.
    drafts: list[list[int]] | None = None
