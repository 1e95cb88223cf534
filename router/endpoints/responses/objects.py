"""The Responses API's bodies and stream events (/v1/responses), as pydantic models: the
schemas /openapi.json publishes; the tests validate every body and event the route emits
against them (as router/endpoints/base.py's for the other routes)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, RootModel

from router.endpoints.base import ResponseModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(ResponseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]  # always empty


class ReasoningTextPart(ResponseModel):
    type: Literal["reasoning_text"]
    text: str


class OutputMessage(ResponseModel):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]  # one part (none while in progress)


class ReasoningOutput(ResponseModel):
    """The model's reasoning, split from its answer by --reasoning-parser."""

    type: Literal["reasoning"]
    id: str
    summary: list[dict[str, Any]]  # always empty
    content: list[ReasoningTextPart]
    status: ItemStatus


class FunctionCallOutput(ResponseModel):
    """A call the model made: the client runs it and sends a `function_call_output` item."""

    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="JSON text of the arguments object")
    status: ItemStatus


OutputItem = Annotated[
    Union[OutputMessage, ReasoningOutput, FunctionCallOutput], Field(discriminator="type")
]


class ResponseFunctionTool(ResponseModel):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class ResponseToolChoiceFunction(ResponseModel):
    type: Literal["function"]
    name: str


class ResponseTextFormat(ResponseModel):
    """`text.format` as the request gave it (default `{"type": "text"}`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseText(ResponseModel):
    format: ResponseTextFormat


class ResponseReasoning(ResponseModel):
    """As the request gave it: only empty values are accepted."""

    effort: None
    summary: None
    generate_summary: None


class ResponseInputTokensDetails(ResponseModel):
    cached_tokens: int  # 0 unless --enable-prompt-tokens-details


class ResponseOutputTokensDetails(ResponseModel):
    reasoning_tokens: int


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseError(ResponseModel):
    code: str
    message: str


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(ResponseModel):
    """A response object: the body of POST /v1/responses, and of the stream's lifecycle events."""

    id: str = Field(description="resp_<32 hex digits>")
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    metadata: dict[str, str]
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ResponseReasoning | None
    store: bool = Field(
        description="kept for previous_response_id (the router's store is on "
        "and the request did not opt out)"
    )
    temperature: float
    top_p: float
    max_output_tokens: int | None
    text: ResponseText
    tool_choice: Union[Literal["none", "auto", "required"], ResponseToolChoiceFunction]
    tools: list[ResponseFunctionTool]
    truncation: Literal["disabled"]
    user: str | None
    background: Literal[False]
    usage: ResponseUsage | None  # null until the response ends


class _Event(ResponseModel):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: ResponsesResponse


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: Annotated[Union[OutputText, ReasoningTextPart], Field(discriminator="type")]


class OutputTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]]  # always empty


class OutputTextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]]


class ReasoningTextDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseStreamEvent(RootModel):
    """One event of a streamed response (`event: <type>`, `data: <this>`)."""

    root: Annotated[
        Union[
            ResponseLifecycleEvent,
            OutputItemEvent,
            ContentPartEvent,
            OutputTextDeltaEvent,
            OutputTextDoneEvent,
            ReasoningTextDeltaEvent,
            ReasoningTextDoneEvent,
            FunctionCallArgumentsDeltaEvent,
            FunctionCallArgumentsDoneEvent,
        ],
        Field(discriminator="type"),
    ]
