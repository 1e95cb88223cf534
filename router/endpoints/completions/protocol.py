"""POST /v1/completions: the request body (the fields this router reads, beside the sampling
fields every generating request shares: router/endpoints/sampling.py) and the response bodies
(the schemas /openapi.json publishes)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field

from router.endpoints.base import (
    FinishReason,
    PromptLogprobs,
    ResponseModel,
    StopReason,
    Usage,
)
from router.endpoints.sampling import SamplingFields


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = Field(
        description="the stop string or token id; null for EOS or length"
    )
    prompt_logprobs: PromptLogprobs | None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason


class CompletionStreamChunk(ResponseModel):
    """One `data:` event of a streamed completion (`usage`: with
    `stream_options.include_usage`; null until the last, usage-only chunk unless
    `continuous_usage_stats`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None
