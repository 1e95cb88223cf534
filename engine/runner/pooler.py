"""The model runner's side of pooling requests (engine/sampling/pooling.py): which rows of a chunk a
request needs, and the partial sums of mean pooling, by request id."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.core.request import Request


@dataclass(slots=True)
class _MeanSum:
    num_pooled: int  # prompt positions summed so far
    total: torch.Tensor  # fp32 sum of their hidden states


class Pooler:
    """The model runner's side of pooling: the rows of a chunk a request needs, and the
    partial sums of mean pooling by request id until the embedding is complete (or the
    request leaves: `forget`; a preempted one starts over from position 0)."""

    def __init__(self) -> None:
        self.partial: dict[str, _MeanSum] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.partial.pop(request_id, None)

    def rows(self, request: Request, start: int, n: int) -> range:
        """Positions of the chunk [start, start + n) whose hidden state `request` needs."""
        num_prompt, params = request.num_prompt_tokens, request.pooling
        assert params is not None  # only pooling requests pool
        if params.needs_every_position:
            summed = self.partial.get(request.request_id)
            return range(max(start, summed.num_pooled if summed else 0), start + n)
        return range(num_prompt - 1, num_prompt) if start + n == num_prompt else range(0)

    def add(self, request: Request, hidden: torch.Tensor) -> list[float] | None:
        """`hidden`: fp32 [len(rows), dim] for the rows `rows` returned, in order; the
        embedding once the last prompt position is among them, else None."""
        params, num_prompt = request.pooling, request.num_prompt_tokens
        assert params is not None  # only pooling requests pool
        if params.needs_every_position:
            summed = self.partial.get(request.request_id)
            if summed is None:
                summed = self.partial[request.request_id] = _MeanSum(0, hidden.sum(0))
            else:
                summed.total = summed.total + hidden.sum(0)
            summed.num_pooled += hidden.shape[0]
            if summed.num_pooled < num_prompt:
                return None
            del self.partial[request.request_id]
            pooled = summed.total / num_prompt
        else:
            pooled = hidden[-1]
        if params.normalize:
            pooled = pooled / pooled.norm(p=2).clamp_min(1e-12)  # F.normalize
        return pooled.tolist()
