"""A chat conversation as the model's chat template sees it: the request's messages as
template input (text parts joined, tool calls' arguments as objects), rendered with the
template; every refusal a 400 naming the field."""

from __future__ import annotations

import inspect
import json
from typing import Any, Mapping

from engine.processing.tokenizer import ChatTemplateError, Tokenizer
from router.endpoints.chat.protocol import ChatCompletionRequest, ChatMessage, TextPart
from router.http.errors import bad_request

# Template variables the renderer sets itself, which chat_template_kwargs cannot replace: the
# arguments of Tokenizer.render_chat (passing one again is a TypeError, which was an HTTP 500)
# and what the request's own fields fill.
_RENDER_ARGUMENTS = frozenset(
    name
    for name, p in inspect.signature(Tokenizer.render_chat).parameters.items()
    if p.kind is not inspect.Parameter.VAR_KEYWORD
)
_FROM_FIELDS = {"tools": "tools", "documents": "documents"}


def template_kwargs(
    kwargs: Mapping[str, Any] | None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The template's further variables: the request's `chat_template_kwargs` (a 400 naming a
    key that the renderer sets itself), then `extra`, what the router adds (`tools`,
    `documents`)."""
    for key in kwargs or {}:
        if key in _RENDER_ARGUMENTS or key in _FROM_FIELDS:
            where = f"chat_template_kwargs.{key}"
            passed = f"the request's `{_FROM_FIELDS[key]}`" if key in _FROM_FIELDS else "its own"
            raise bad_request(
                f"{where}: {key!r} is reserved: the server passes {passed} to the chat "
                "template under that name",
                where,
            )
    return {**(kwargs or {}), **(extra or {})}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The chat template's input: text parts joined with newlines (vLLM's string content
    format); `name`, `tool_call_id` and reasoning kept; tool calls' arguments as objects (as
    templates write them: `arguments | tojson`)."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            text = m.content or ""
        else:
            parts = []
            for j, part in enumerate(m.content):
                if not isinstance(part, TextPart):
                    where = f"messages.{i}.content.{j}.type"
                    raise bad_request(
                        f"{where}: content part type {part.type!r} is not supported (only text)",
                        where,
                    )
                parts.append(part.text)
            text = "\n".join(parts)
        message: dict[str, Any] = {"role": m.role, "content": text}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [
                _template_call(i, j, call) for j, call in enumerate(m.tool_calls)
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        out.append(message)
    return out


def render_chat(
    tok: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: Mapping[str, Any] | None,
    explicit_agp: bool,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """`kwargs`: the request's chat_template_kwargs; `extra`: template variables the router
    adds (`template_kwargs`). `explicit_agp`: add_generation_prompt was set in the request
    (its default, true, yields to continue_final_message)."""
    variables = template_kwargs(kwargs, extra)
    if continue_final_message:
        if add_generation_prompt and explicit_agp:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        add_generation_prompt = False
    try:
        return tok.render_chat(
            chat_messages(messages), add_generation_prompt, continue_final_message, **variables
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None


def _template_call(i: int, j: int, call) -> dict[str, Any]:
    where = f"messages.{i}.tool_calls.{j}.function.arguments"
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise bad_request(f"{where} must be JSON text of an object", where) from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where} must be JSON text of an object", where)
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def chat_text(
    req: ChatCompletionRequest, tok: Tokenizer, extra: Mapping[str, Any] | None = None
) -> str:
    """The rendered conversation. `extra`: template variables the router adds (`tools`)."""
    added = dict(extra or {})
    if req.documents is not None:
        added["documents"] = req.documents
    return render_chat(
        tok,
        req.messages,
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template_kwargs,
        "add_generation_prompt" in req.model_fields_set,
        added,
    )
