"""The response bodies the router emits, as pydantic models: the schemas /openapi.json
publishes (router/openapi.py). router/responses.py and router/info_routes.py build plain dicts
on the hot path; tests validate what they emit against these models
(tests/router/api_fuzz.py validates every body and SSE event of the fuzz run), so a
field added there and not here fails a test.

Models forbid fields they do not declare (the published schema says exactly what comes back).
A field with a default may be left out of a body; one without is always present (maybe null).
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from cluster.roles import Role

FinishReason = Literal["stop", "length", "tool_calls"]
StopReason = Union[str, int, None]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- errors ---------------------------------------------------------------------------------
class ErrorInfo(_Out):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, "
                                  "not_found_error, server_error, ...")
    param: str | None = Field(description="the request field at fault (`messages.0.role`)")
    code: str | None = Field(description="e.g. context_length_exceeded, invalid_value")


class ErrorResponse(_Out):
    """Every 4xx/5xx body (OpenAI's shape); also a stream's last event before `[DONE]` when
    it fails after the first token."""

    error: ErrorInfo


# ---- shared -----------------------------------------------------------------------------------
class PromptTokensDetails(_Out):
    cached_tokens: int  # prompt tokens served from a prefix cache


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Union[PromptTokensDetails, None]  # null unless --enable-prompt-tokens-details


class PromptLogprob(_Out):
    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's prompt_logprobs: null for the first prompt token, then token id -> entry."""


# ---- completions ------------------------------------------------------------------------------
class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = Field(description="the stop string or token id; null for EOS "
                                                "or length")
    prompt_logprobs: PromptLogprobs | None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason


class CompletionStreamChunk(_Out):
    """One `data:` event of a streamed completion (`usage`: with
    `stream_options.include_usage`; null until the last, usage-only chunk unless
    `continuous_usage_stats`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


# ---- chat -------------------------------------------------------------------------------------
class ChatTopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class FunctionCallOut(_Out):
    name: str
    arguments: str = Field(description="JSON text of the arguments object")


class ToolCallOut(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatCompletionMessage(_Out):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the message only calls tools")
    tool_calls: list[ToolCallOut] | None = Field(default=None, description="present when the model "
                                          "called tools")
    reasoning_content: str | None = Field(default=None, description="with --reasoning-parser: "
                                          "the model's reasoning (vLLM's name)")
    reasoning: str | None = Field(default=None, description="the same as reasoning_content "
                                  "(vLLM's newer name)")


class ChatChoice(_Out):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None


class FunctionCallDelta(_Out):
    name: str | None = None  # the call's first piece
    arguments: str | None = None  # more of the arguments' JSON text


class ToolCallDeltaOut(_Out):
    """A piece of a call: the first carries `id`, `type` and `function.name`; the others
    more `function.arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatStreamChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None  # absent from the opening (role) chunk


class ChatCompletionStreamChunk(_Out):
    """One `data:` event of a streamed chat completion (`usage` as for completions)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# ---- side endpoints ---------------------------------------------------------------------------
class ModelInfo(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = None  # a LoRA adapter: the base model's id


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelInfo]


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(_Out):
    prompt: str


class VersionResponse(_Out):
    version: str


class HealthResponse(_Out):
    """200 when a decode worker is usable, else 503 (`no_decode_workers`)."""

    status: Literal["ok", "no_decode_workers"]
    decode_workers: int
    prefill_workers: int


class Embedding(_Out):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str]  # floats, or base64 of little-endian float32


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class DashboardWorker(_Out):
    """One registered worker as /dashboard shows it (from its latest etcd registration)."""

    worker_id: str
    role: Role
    state: Literal["ready", "draining", "stale"]
    address: str
    kv_usage: float  # 1 - free/total blocks (0 when total is unknown)
    total_blocks: int
    free_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float
    inflight: int  # this router's requests on it
    kv_bytes: float | None  # KV bytes sent + received so far (its /metrics); None: not scraped


class DashboardDecision(_Out):
    time: float  # unix seconds
    policy: str
    reason: str
    decode: Union[str, None]
    prefill: Union[str, None]
    predicted_cached_tokens: int


class DashboardData(_Out):
    """GET /dashboard/data: what the live cluster page polls. Counters are cumulative (the
    page derives rates between polls); ttft_s / itl_s are the most recent samples."""

    time: float  # unix seconds
    model: str
    workers: list[DashboardWorker]
    requests_total: int  # generation requests answered (completions + chat), any status
    running: int
    waiting: int
    decisions: dict[str, int]  # placement decisions by reason
    prompt_tokens: int
    generation_tokens: int
    prefix_hit_tokens: int  # prompt tokens the workers found cached
    tool_requests: int  # chat requests that declared tools
    tool_calls: int  # tool calls returned
    reasoning_requests: int  # chat requests read with the reasoning parser
    ttft_s: list[float]
    itl_s: list[float]
    recent_decisions: list[DashboardDecision]
