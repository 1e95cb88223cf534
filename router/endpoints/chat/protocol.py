"""POST /v1/chat/completions: the request body (messages, tools, beside the sampling fields
every generating request shares: router/endpoints/sampling.py) and the response bodies (the
schemas /openapi.json publishes)."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field

from router.endpoints.base import (
    FinishReason,
    PromptLogprobs,
    RequestModel,
    ResponseModel,
    StopReason,
    Usage,
)
from router.endpoints.sampling import LACKING, SamplingFields


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class OtherPart(RequestModel):
    type: str


class FunctionCall(RequestModel):
    name: str
    arguments: str
    """JSON text of the arguments object (as the model wrote it)."""


class MessageToolCall(RequestModel):
    """A call an earlier assistant turn made (`messages[i].tool_calls[j]`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Union[TextPart, OtherPart]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this is the result of
    reasoning_content: str | None = None  # assistant turns of a reasoning model (vLLM)
    reasoning: str | None = None


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestModel):
    """One entry of `tools` (OpenAI: function tools only)."""

    type: str
    function: FunctionDefinition | None = None


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    handled_extra = frozenset({*LACKING, "echo"})  # echo: refused (completions only)

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None
    add_special_tokens: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True


class ChatTopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob]


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str = Field(description="JSON text of the arguments object")


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatCompletionMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the message only calls tools")
    tool_calls: list[ToolCallOut] | None = Field(
        default=None, description="present when the model called tools"
    )
    reasoning_content: str | None = Field(
        default=None, description="with --reasoning-parser: the model's reasoning (vLLM's name)"
    )
    reasoning: str | None = Field(
        default=None, description="the same as reasoning_content (vLLM's newer name)"
    )


class ChatChoice(ResponseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None


class FunctionCallDelta(ResponseModel):
    name: str | None = None  # the call's first piece
    arguments: str | None = None  # more of the arguments' JSON text


class ToolCallDeltaOut(ResponseModel):
    """A piece of a call: the first carries `id`, `type` and `function.name`; the others
    more `function.arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None  # absent from the opening (role) chunk


class ChatCompletionStreamChunk(ResponseModel):
    """One `data:` event of a streamed chat completion (`usage` as for completions)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
