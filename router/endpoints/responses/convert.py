"""A Responses request as a chat completion request: its input items as chat messages, its
tools, tool choice and text format in chat's shapes. The chat pipeline then prepares it
(router/generation/prepare.py), so both APIs share one template, tokenizer, tool and
structured-output
path; a refusal there is renamed to the Responses field (`renamed`).

Input items -> chat messages, one assistant message per turn as a turn's output lists it
(reasoning, then text, then calls):
- `reasoning`: an assistant message's `reasoning_content` (its content parts' text, else its
  summary's); the chat template decides whether earlier turns' reasoning is shown;
- a message: its role and text (parts as chat's text parts: the template joins them); an
  assistant message right after reasoning is that message's content;
- `function_call` items: `tool_calls` of the assistant message they follow (or a new one);
- `function_call_output`: a `tool` message answering `call_id`.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import TypeAdapter

from router.endpoints.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from router.http.errors import APIError

_OUTPUT_AS_INPUT = TypeAdapter(list[InputItem])
_PASSED = (
    "temperature",
    "top_p",
    "user",
    "parallel_tool_calls",
    "top_k",
    "seed",
    "stop",
    "repetition_penalty",
    "priority",
    "cache_salt",
)
"""Fields chat takes under the same name and meaning."""


def input_messages(input: str | list) -> list[dict[str, Any]]:
    """The chat messages of a request's `input` (a string is one user message)."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    out: list[dict[str, Any]] = []
    for item in input:
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if isinstance(item, MessageItem):
            content = (
                item.content
                if isinstance(item.content, str)
                else [{"type": "text", "text": part.text} for part in item.content]
            )
            if (
                item.role == "assistant"
                and last is not None
                and last["content"] is None
                and "tool_calls" not in last
            ):
                last["content"] = content  # the answer after this turn's reasoning
            else:
                out.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        elif isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "".join(part.text for part in parts),
                }
            )
    return out


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages they add to the conversation: what
    sending them back as input gives."""
    return input_messages(_OUTPUT_AS_INPUT.validate_python(output))


def chat_body(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request for `req`, whose messages are `conversation` (earlier
    turns and this input) after the instructions."""
    messages = (
        [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    ) + conversation
    body: dict[str, Any] = {"messages": messages, "stream": bool(req.stream)}
    if req.model is not None:
        body["model"] = req.model
    for name in _PASSED:
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools is not None:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in req.tools
        ]
    if req.tool_choice is not None:
        body["tool_choice"] = (
            req.tool_choice
            if isinstance(req.tool_choice, str)
            else {"type": "function", "function": {"name": req.tool_choice.name}}
        )
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJsonSchema):
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True),
        }
    elif isinstance(fmt, TextFormatJsonObject):
        body["response_format"] = {"type": "json_object"}
    return body


_RENAMES = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("messages", "input"),
)
_CHAT_NAMES = re.compile(r"\b(max_completion_tokens|response_format|messages)\b")
_NESTED = re.compile(
    r"^(tools\.\d+\.function|tool_choice\.function|"
    r"response_format\.json_schema)\b"
)


def renamed(exc: APIError) -> APIError:
    """A refusal of the chat request, naming the Responses fields instead (`messages.3.content`
    is `input`: chat's message index counts the instructions and earlier turns)."""
    param = exc.param
    if param is not None:
        param = _NESTED.sub(lambda m: m.group(1).rsplit(".", 1)[0], param)  # chat nests these
        for chat, responses in _RENAMES:
            if param == chat or param.startswith(chat + "."):
                param = responses if chat == "messages" else responses + param[len(chat) :]
    message = (
        exc.message
        if param == exc.param or exc.param is None or param is None
        else exc.message.replace(exc.param, param)
    )
    message = _CHAT_NAMES.sub(lambda m: dict(_RENAMES)[m.group(1)], message)
    return APIError(exc.status, message, param, exc.code, exc.headers)
