"""A step's logits controls — allowed_token_ids, bad_words and logit_bias — for the whole batch.

Each request contributes a handful of (row, token[, value]) entries, so a step gathers them
into small index tensors and touches the [B, V] logits once per control (index_add /
index_put); the Python work grows with the entries, never with the vocabulary.

bad_words arrive as token-id sequences (the front end tokenized each word with and without a
leading space). A sequence's last token is banned at the position where it would complete
the word: always for a one-token word, and for a longer one only when the tokens generated so
far end in the word's other tokens (generated tokens only, not the prompt, as vLLM does).

Structured outputs' token bitmask (apply_token_bitmask_) is such a mask too, applied by the
step's sampler before all of these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from shardserve.model import native_kernels
from shardserve.sampling_params import SamplingParams


class _SamplingState(Protocol):
    params: SamplingParams
    output_token_ids: list[int]


@dataclass
class LogitsControls:
    """Index tensors of one step; each group is None when no row of the batch uses it."""

    allowed_rows: torch.Tensor | None  # int64 [R]: batch rows restricted to a set
    allowed_index: torch.Tensor | None  # int64 [K]: into allowed_rows, with allowed_ids
    allowed_ids: torch.Tensor | None  # int64 [K]
    banned_rows: torch.Tensor | None  # int64 [M]: (row, token) completing a bad word
    banned_ids: torch.Tensor | None  # int64 [M]
    bias_rows: torch.Tensor | None  # int64 [N]: (row, token, bias) of logit_bias
    bias_ids: torch.Tensor | None  # int64 [N]
    bias_values: torch.Tensor | None  # float32 [N]

    @classmethod
    def build(cls, states: Sequence[_SamplingState],
              device: torch.device | str = "cpu") -> LogitsControls | None:
        """None when no request of the batch uses a control (the common case: no cost)."""
        if not any(s.params.has_logits_controls for s in states):
            return None
        allowed_rows, allowed_index, allowed_ids = _allowed_entries(states)
        banned_rows, banned_ids = _banned_entries(states)
        bias_rows, bias_ids, bias_values = _bias_entries(states)
        return cls(
            allowed_rows=_ints(allowed_rows, device),
            allowed_index=_ints(allowed_index, device),
            allowed_ids=_ints(allowed_ids, device),
            banned_rows=_ints(banned_rows, device),
            banned_ids=_ints(banned_ids, device),
            bias_rows=_ints(bias_rows, device),
            bias_ids=_ints(bias_ids, device),
            bias_values=torch.tensor(bias_values, dtype=torch.float32, device=device)
            if bias_values else None,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The controlled logits, as a new tensor (the caller's is never written to)."""
        neg_inf = float("-inf")
        if self.allowed_rows is not None:
            # -inf everywhere but the allowed ids, added to just the restricted rows.
            mask = torch.full((self.allowed_rows.shape[0], logits.shape[1]), neg_inf,
                              dtype=logits.dtype, device=logits.device)
            mask[self.allowed_index, self.allowed_ids] = 0.0
            logits = logits.index_add(0, self.allowed_rows, mask)
        if self.banned_rows is not None:
            logits = logits.index_put((self.banned_rows, self.banned_ids),
                                      torch.tensor(neg_inf, dtype=logits.dtype,
                                                   device=logits.device))
        if self.bias_rows is not None:
            # After the bans: a banned token stays -inf whatever its bias.
            logits = logits.index_put((self.bias_rows, self.bias_ids),
                                      self.bias_values.to(logits.dtype), accumulate=True)
        return logits


def _ints(values: list[int], device: torch.device | str) -> torch.Tensor | None:
    return torch.tensor(values, dtype=torch.int64, device=device) if values else None


def _allowed_entries(states: Sequence[_SamplingState]
                     ) -> tuple[list[int], list[int], list[int]]:
    rows: list[int] = []
    index: list[int] = []
    ids: list[int] = []
    for row, state in enumerate(states):
        allowed = state.params.allowed_token_ids
        if allowed:
            index.extend([len(rows)] * len(allowed))
            ids.extend(allowed)
            rows.append(row)
    return rows, index, ids


def _banned_entries(states: Sequence[_SamplingState]) -> tuple[list[int], list[int]]:
    """(row, token) pairs: each bad word's last token, where the output so far ends in the
    word's other tokens."""
    rows: list[int] = []
    ids: list[int] = []
    for row, state in enumerate(states):
        sequences = state.params.bad_words_token_ids
        if not sequences:
            continue
        output = state.output_token_ids
        for seq in sequences:
            head = len(seq) - 1
            if head == 0 or (len(output) >= head and output[len(output) - head:] == seq[:-1]):
                rows.append(row)
                ids.append(seq[-1])
    return rows, ids


def _bias_entries(states: Sequence[_SamplingState]
                  ) -> tuple[list[int], list[int], list[float]]:
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for row, state in enumerate(states):
        bias = state.params.logit_bias
        if bias:
            rows.extend([row] * len(bias))
            ids.extend(bias)
            values.extend(bias.values())
    return rows, ids, values


def apply_token_bitmask_(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """Structured outputs, in place: every token whose bit is clear in `bitmask` row r (int32
    words, xgrammar's layout; see messages.GrammarOutput) gets -inf in logits row rows[r]. The
    C kernel where it applies; else the bitmask is unpacked and torch fills."""
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64)
    packed = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32))
    if native_kernels.supports(torch.float32, logits.device) and logits.dtype == torch.float32 \
            and logits.stride(-1) == 1:
        native_kernels.apply_token_bitmask_(logits, index, packed)
        return
    vocab = logits.shape[-1]
    disallowed = np.unpackbits(np.ascontiguousarray(~bitmask, dtype="<i4").view(np.uint8),
                               axis=1, bitorder="little")[:, :vocab].view(bool)
    index = index.to(logits.device)
    block = logits[index].masked_fill_(torch.from_numpy(disallowed).to(logits.device),
                                       float("-inf"))
    logits[index] = block
