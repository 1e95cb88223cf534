"""The /v1/responses request body: the fields this server acts on, and nothing else.

Unlike the chat and completion bodies (router/endpoints/sampling.py), which ignore fields they do not
know as vLLM does, every model here forbids undeclared fields: an unknown or unsupported
field is a 400 naming it. A value that asks for something pdserve cannot do (`background`,
`truncation: "auto"`, a reasoning effort, `include`) is a 400 too (`check`).

Output items come back as input items (a client sends the previous output with its next
message): messages with `output_text` parts, `function_call` and `reasoning` items parse here.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag,
                      ValidationError)

from router.http.errors import APIError, bad_request, from_validation_errors

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class TextContent(_Strict):
    """A message's text part: `input_text`, or `output_text` (an earlier answer sent back;
    its annotations and logprobs are output details, not read)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]
    id: str | None = None  # an output message sent back
    status: ItemStatus | None = None


class FunctionCallItem(_Strict):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Strict):
    """The result of an earlier call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: ItemStatus | None = None


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    """Reasoning of an earlier turn sent back: the `reasoning_content` of that turn's
    assistant message (its template decides whether to show it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: ItemStatus | None = None


_ITEM_TAGS = {"message": "Message", "function_call": "FunctionCall",
              "function_call_output": "FunctionCallOutput", "reasoning": "Reasoning"}


def _item_tag(value: Any) -> str | None:
    """The union member for an input item: by its `type` (a message may leave it out). Tags
    are class-like names, which error paths leave out (`_path`)."""
    if not isinstance(value, dict):
        return "Message"  # its refusal: "input.N: Input should be an object"
    kind = value.get("type", "message")
    return _ITEM_TAGS.get(kind, kind) if isinstance(kind, str) else repr(kind)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("Message")],
                            Annotated[FunctionCallItem, Tag("FunctionCall")],
                            Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
                            Annotated[ReasoningItem, Tag("Reasoning")]],
                      Discriminator(_item_tag)]


class FunctionToolParam(_Strict):
    """A function tool, in the Responses API's flat shape (chat nests it under `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


TextFormat = Annotated[Union[TextFormatText, TextFormatJsonSchema, TextFormatJsonObject],
                       Field(discriminator="type")]


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningParam(_Strict):
    """Accepted only empty: the router cannot make a model reason more or less, nor summarize."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class ResponsesRequest(_Strict):
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
    (`refusal`)."""
    try:
        return ResponsesRequest.model_validate_json(body or b"", strict=True)
    except ValidationError as exc:
        raise refusal(exc.errors()) from None


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|list|dict|none|[A-Z]\w*)$|[\[\]\-]")
"""A union member pydantic puts in an error's location (`str`, `list[...]`, a tag)."""


def _path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and _UNION_MEMBER.search(p)))


def refusal(errors: list[dict]) -> APIError:
    """The 400 for a body that does not parse. A `type` this server does not serve is named
    first (the most telling refusal: `tools.0.type: 'web_search' is not supported`), then an
    unknown field; else the first error (a missing field first, then the deepest), at its
    path without the union members."""
    for e in errors:
        if e["type"] == "union_tag_invalid" or (e["type"] == "literal_error"
                                                and e["loc"][-1:] == ("type",)):
            param = _path(e["loc"])
            if e["type"] == "union_tag_invalid":
                param += ".type"
                value, expected = e["ctx"]["tag"], _expected_tags(e["ctx"]["expected_tags"])
            else:
                value, expected = e["input"], e["ctx"]["expected"]
            return bad_request(f"{param}: {value!r} is not supported by /v1/responses "
                               f"(supported: {expected})", param, "unsupported_value")
    for e in errors:
        if e["type"] == "extra_forbidden":
            param = _path(e["loc"])
            return bad_request(f"{param}: unknown or unsupported field (/v1/responses refuses "
                               "the fields it does not act on)", param, "unsupported_field")
    paths = [_path(e["loc"]) for e in errors]
    first = min(range(len(errors)), key=lambda i: (errors[i]["type"] != "missing",
                                                   -len(errors[i]["loc"])))
    param, message = paths[first], errors[first]["msg"]
    if not param:  # not JSON, not an object
        return from_validation_errors(errors)
    if paths.count(param) > 1:  # each member of a union refused the value
        message = f"none of the accepted types matches (e.g. {message[0].lower() + message[1:]})"
    return bad_request(f"{param}: {message}", param, "invalid_value")


def _expected_tags(tags: str) -> str:
    """pydantic's expected tags ("'Message', 'FunctionCall'") as the item types they stand for."""
    names = {v: k for k, v in _ITEM_TAGS.items()}
    return ", ".join(repr(names.get(t.strip(" '"), t.strip(" '"))) for t in tags.split(","))


def check(req: ResponsesRequest) -> None:
    """Refuses values that ask for what this server cannot do (400 naming the field)."""
    if req.background:
        raise bad_request("background responses are not supported (this server answers "
                          "while the request is open)", "background", "unsupported_value")
    if req.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported: an input that does not fit "
                          "the context is a 400 ('disabled')", "truncation", "unsupported_value")
    if req.include:
        raise bad_request(f"include.0: {req.include[0]!r} is not supported by /v1/responses "
                          "(nothing can be included)", "include.0", "unsupported_value")
    if req.reasoning is not None:
        for name, value in req.reasoning:
            if value is not None:
                raise bad_request(f"reasoning.{name} is not supported (the model reasons as its "
                                  "chat template and --reasoning-parser make it)",
                                  f"reasoning.{name}", "unsupported_value")
