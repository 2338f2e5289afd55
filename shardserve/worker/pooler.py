"""Pooling on the last pipeline stage: one vector a pooling request, from the final hidden
states (after the model's final norm) of its prompt tokens.

A prompt may arrive in several prefill chunks (chunked prefill), so MEAN keeps a running
float32 sum and count per request until its last chunk, and CLS keeps the first token's state
from the chunk that starts at position 0. LAST needs only the last chunk. The scheduler never
lets MEAN or CLS skip positions through the prefix cache (PoolingSpec.needs_every_position);
LAST may, as its last token is always computed. A preempted request restarts from position 0
and its partial state with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from shardserve.pooling_params import PoolingSpec


class PoolingState(Protocol):
    """What the pooler reads of a request (the model runner's CachedRequestState)."""

    req_id: str
    num_computed_tokens: int  # before this step's chunk

    @property
    def num_tokens(self) -> int: ...


@dataclass
class _Partial:
    total: torch.Tensor  # float32 [hidden]: MEAN's running sum, or CLS's first state
    count: int


class RequestPooler:
    def __init__(self) -> None:
        self._partial: dict[str, _Partial] = {}

    def drop(self, req_id: str) -> None:
        """Forget a request's partial state (finished, aborted or preempted)."""
        self._partial.pop(req_id, None)

    def pool(self, states: Sequence[PoolingState], specs: Sequence[PoolingSpec | None],
             query_lens: Sequence[int], hidden: torch.Tensor) -> dict[str, np.ndarray]:
        """This step's rows: `hidden` [sum(query_lens), hidden_size], requests in order.
        Returns the vectors of pooling requests whose prompt completes with this chunk."""
        done: list[tuple[str, torch.Tensor, bool]] = []
        offset = 0
        for s, spec, n in zip(states, specs, query_lens, strict=True):
            if spec is not None:
                vector = self._chunk(s, spec, hidden[offset:offset + n])
                if vector is not None:
                    done.append((s.req_id, vector, spec.normalize))
            offset += n
        if not done:
            return {}
        vectors = torch.stack([v for _, v, _ in done])
        norm = torch.tensor([flag for _, _, flag in done], device=vectors.device)
        normalized = torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
        vectors = torch.where(norm[:, None], normalized, vectors).cpu().numpy()
        return {rid: vectors[i] for i, (rid, _, _) in enumerate(done)}

    def _chunk(self, s: PoolingState, spec: PoolingSpec, rows: torch.Tensor
               ) -> torch.Tensor | None:
        """Fold one chunk in; the request's float32 vector once its prompt is complete."""
        start, n = s.num_computed_tokens, rows.shape[0]
        last = start + n == s.num_tokens
        if spec.pooling_type == "LAST":
            return rows[-1].float() if last else None
        if start == 0:
            self._partial.pop(s.req_id, None)
        part = self._partial.get(s.req_id)
        if spec.pooling_type == "CLS":
            part = part or _Partial(rows[0].float(), 1)
        else:  # MEAN
            chunk_sum = rows.float().sum(dim=0)
            part = _Partial(chunk_sum, n) if part is None else \
                _Partial(part.total + chunk_sum, part.count + n)
        if not last:
            self._partial[s.req_id] = part
            return None
        self._partial.pop(s.req_id, None)
        return part.total / part.count
