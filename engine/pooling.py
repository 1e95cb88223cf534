"""Pooling requests (embeddings): a prompt-only request whose result is the final-normed hidden
state of the last layer, pooled over the prompt, instead of sampled tokens — vLLM's default
pooler for decoder models used as embedding models (last token, L2-normalized).

Life cycle: the request prefills like any other (chunked, batched with other requests in the
same step); the model runner asks the model for the hidden state only at the rows this
request pools (the last prompt position; every position for mean pooling) and records the
result here, chunk by chunk; the scheduler finishes the request ("stop") once its prompt is
computed, without sampling. Mean pooling needs every position's hidden state, so it gets no
prefix-cache hits (like prompt logprobs); last-token pooling reuses cached prefix blocks (the
last position is always computed)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from engine.checks import check_fields

if TYPE_CHECKING:
    import torch

PoolingType = Literal["last", "mean"]


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: PoolingType = "last"
    """last: the last prompt token's hidden state; mean: the average over every prompt token."""
    normalize: bool = True
    """L2-normalize the pooled vector (vLLM's default for embeddings)."""

    def __post_init__(self) -> None:
        check_fields(self, [(self.pooling_type in ("last", "mean"), "pooling_type",
                             "must be 'last' or 'mean'")])

    @property
    def needs_every_position(self) -> bool:
        return self.pooling_type == "mean"


@dataclass(slots=True)
class PoolingState:
    """What a pooling request has gathered so far (kept across preemption: a recomputed
    position gives the same hidden state, so positions already summed are skipped)."""

    params: PoolingParams
    num_pooled: int = 0  # mean: prompt positions summed so far
    total: "torch.Tensor | None" = None  # mean: fp32 sum of their hidden states
    embedding: list[float] | None = None  # set once the prompt is computed

    def rows(self, start: int, n: int, num_prompt: int) -> range:
        """Positions of the chunk [start, start + n) whose hidden state this request needs."""
        if self.params.needs_every_position:
            return range(max(start, self.num_pooled), start + n)
        return range(num_prompt - 1, num_prompt) if start + n == num_prompt else range(0)

    def add(self, hidden: "torch.Tensor", num_prompt: int) -> None:
        """`hidden`: fp32 [len(rows), dim] for the rows `rows` returned, in order; completes
        the embedding when the last prompt position is among them."""
        if self.params.needs_every_position:
            part = hidden.sum(0)
            self.total = part if self.total is None else self.total + part
            self.num_pooled += hidden.shape[0]
            if self.num_pooled < num_prompt:
                return
            pooled = self.total / num_prompt
        else:
            pooled = hidden[-1]
        if self.params.normalize:
            pooled = pooled / pooled.norm(p=2).clamp_min(1e-12)  # F.normalize
        self.embedding = pooled.tolist()
