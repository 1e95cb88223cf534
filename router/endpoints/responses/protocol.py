"""The /v1/responses request body: the fields this server acts on.

Unknown fields follow the one policy of every request body (router/endpoints/base.py: ignored
with a warning); a known vLLM / OpenAI field this endpoint does not act on (`REFUSED`) is a
400 naming it, and so is a value that asks for something pdserve cannot do (`background`,
`truncation: "auto"`, a reasoning effort, `include`): `check`.

Output items come back as input items (a client sends the previous output with its next
message): messages with `output_text` parts, `function_call` and `reasoning` items parse here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationError,
)

from router.endpoints.base import RequestModel
from router.endpoints.chat.protocol import ChatCompletionRequest
from router.endpoints.sampling import LACKING
from router.http.errors import bad_request, from_validation_errors

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Param(RequestModel):
    """Every model of this body: the one unknown-field policy (router/endpoints/base.py)."""

    model_config = ConfigDict(populate_by_name=True)


class TextContent(_Param):
    """A message's text part: `input_text`, or `output_text` (an earlier answer sent back;
    its annotations and logprobs are output details, not read)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class MessageItem(_Param):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]
    id: str | None = None  # an output message sent back
    status: ItemStatus | None = None


class FunctionCallItem(_Param):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Param):
    """The result of an earlier call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: ItemStatus | None = None


class SummaryText(_Param):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Param):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Param):
    """Reasoning of an earlier turn sent back: the `reasoning_content` of that turn's
    assistant message (its template decides whether to show it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: ItemStatus | None = None


_ITEM_TAGS = {
    "message": "Message",
    "function_call": "FunctionCall",
    "function_call_output": "FunctionCallOutput",
    "reasoning": "Reasoning",
}


def _item_tag(value: Any) -> str | None:
    """The union member for an input item: by its `type` (a message may leave it out). Tags
    are class-like names, which error paths leave out (`_path`)."""
    if not isinstance(value, dict):
        return "Message"  # its refusal: "input.N: Input should be an object"
    kind = value.get("type", "message")
    return _ITEM_TAGS.get(kind, kind) if isinstance(kind, str) else repr(kind)


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("Message")],
        Annotated[FunctionCallItem, Tag("FunctionCall")],
        Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
        Annotated[ReasoningItem, Tag("Reasoning")],
    ],
    Discriminator(_item_tag),
]


class FunctionToolParam(_Param):
    """A function tool, in the Responses API's flat shape (chat nests it under `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Param):
    type: Literal["function"]
    name: str


class TextFormatText(_Param):
    type: Literal["text"]


class TextFormatJsonSchema(_Param):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextFormatJsonObject(_Param):
    type: Literal["json_object"]


TextFormat = Annotated[
    Union[TextFormatText, TextFormatJsonSchema, TextFormatJsonObject], Field(discriminator="type")
]


class TextConfig(_Param):
    format: TextFormat | None = None


class ReasoningParam(_Param):
    """Accepted only empty: the router cannot make a model reason more or less, nor summarize."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


REFUSED = frozenset(
    {
        # OpenAI's Responses parameters this server does not act on.
        "conversation",
        "max_tool_calls",
        "prompt",
        "prompt_cache_key",
        "safety_identifier",
        "service_tier",
        "stream_options",
        "top_logprobs",
        # What a chat or completion request takes (and vLLM's fields pdserve lacks), which a
        # client might send here as well: /v1/responses does not take it.
        *ChatCompletionRequest.model_fields,
        *LACKING,
        "logprobs",
        "echo",
        "suffix",
        "best_of",
    }
)
"""Known vLLM / OpenAI fields /v1/responses refuses by name when set (ResponsesRequest's own
fields are left out below)."""


class ResponsesRequest(_Param):
    handled_extra = REFUSED  # refused by name when set (`check`), not ignored

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    """A system message before everything else (not carried over by previous_response_id)."""
    tools: list[FunctionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    store: bool | None = None
    """Keep this response for previous_response_id (default true, when the router's store
    is on)."""
    previous_response_id: str | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    user: str | None = None
    reasoning: ReasoningParam | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    # vLLM's extras, as its Responses server takes them: passed to chat unchanged.
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    priority: int | None = None
    cache_salt: str | None = None


def parse_request(body: bytes) -> ResponsesRequest:
    """`body` as a ResponsesRequest, strictly from JSON; else the 400 naming the field
    (router/http/errors.py: `from_validation_errors`, reading tagged unions)."""
    try:
        return ResponsesRequest.model_validate_json(body or b"", strict=True)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(), tags=_ITEM_TAGS, where="/v1/responses") from None


def check(req: ResponsesRequest) -> None:
    """Refuses values that ask for what this server cannot do, and the known fields it does
    not act on (`REFUSED`, when set): a 400 naming the field."""
    for name, value in (req.model_extra or {}).items():
        if name in REFUSED and value is not None:
            raise bad_request(
                f"{name}: unsupported field (/v1/responses refuses the known "
                "fields it does not act on)",
                name,
                "unsupported_field",
            )
    if req.background:
        raise bad_request(
            "background responses are not supported (this server answers "
            "while the request is open)",
            "background",
            "unsupported_value",
        )
    if req.truncation == "auto":
        raise bad_request(
            "truncation 'auto' is not supported: an input that does not fit "
            "the context is a 400 ('disabled')",
            "truncation",
            "unsupported_value",
        )
    if req.include:
        raise bad_request(
            f"include.0: {req.include[0]!r} is not supported by /v1/responses "
            "(nothing can be included)",
            "include.0",
            "unsupported_value",
        )
    if req.reasoning is not None:
        for name, value in req.reasoning:
            if value is not None:
                raise bad_request(
                    f"reasoning.{name} is not supported (the model reasons as its "
                    "chat template and --reasoning-parser make it)",
                    f"reasoning.{name}",
                    "unsupported_value",
                )
