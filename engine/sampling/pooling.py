"""Pooling requests (embeddings): a prompt-only request whose result is the final-normed hidden
state of the last layer, pooled over the prompt, instead of sampled tokens — vLLM's default
pooler for decoder models used as embedding models (last token, L2-normalized).

Life cycle: the request prefills like any other (chunked, batched with other requests in the
same step); the model runner asks the model for the hidden state only at the rows this
request pools (the last prompt position; every position for mean pooling) and folds it in
(engine/runner/pooler.py), chunk by chunk; the output of the step that computes the last prompt
position carries the embedding, and the scheduler sets `Request.embedding` and finishes the
request ("stop") without sampling. Mean pooling needs every position's hidden state, so it
gets no prefix-cache hits (like prompt logprobs); last-token pooling reuses cached prefix
blocks (the last position is always computed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.checks import check_fields

PoolingType = Literal["last", "mean"]


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: PoolingType = "last"
    """last: the last prompt token's hidden state; mean: the average over every prompt token."""
    normalize: bool = True
    """L2-normalize the pooled vector (vLLM's default for embeddings)."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            [(self.pooling_type in ("last", "mean"), "pooling_type", "must be 'last' or 'mean'")],
        )

    @property
    def needs_every_position(self) -> bool:
        return self.pooling_type == "mean"
