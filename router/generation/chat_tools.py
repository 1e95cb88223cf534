"""A chat request's tools, tool choice and reasoning, read at the router before anything
runs: which output setup (router/parsers/message.py) reads the answer, which constraint makes the
calls valid, what the chat template gets. Every refusal is a 400 naming the field.

- `tool_choice` defaults to "auto" when `tools` are given (OpenAI's rule), which needs the
  server's --enable-auto-tool-choice and --tool-call-parser (vLLM's rule).
- "required" and a named function are constrained (a JSON schema of the calls, compact: a
  model cannot stall in optional whitespace), "auto" is
  constrained after the parser's call marker when the format has one (the parser's
  structural tag): calls are valid against their tool's schema by construction. None of these
  combines with another structured-output constraint (two constraints cannot both hold).
- A template that never mentions `tools` (or `tool_calls`, or the `tool` role, for a
  conversation that has them) cannot render them: a 400 says which, and that
  --chat-template can supply a template that can.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.processing.tokenizer import Tokenizer
from engine.structured.params import StructuredOutputsParams
from router.endpoints.chat.protocol import (
    ChatCompletionRequest,
    ChatTool,
    NamedToolChoice,
)
from router.generation.structured import Constraint
from router.http.errors import bad_request
from router.parsers.message import (
    ChatOptions,
    OutputSetup,
    ToolChoice,
    required_calls_schema,
)
from router.parsers.tools.parser import ToolParser
from router.parsers.tools.types import FunctionTool

_TEMPLATE_HINT = (
    "pass a chat template that does with --chat-template "
    "(examples/tool_chat_template_chatml.jinja for ChatML models)"
)


@dataclass(frozen=True)
class ChatTools:
    """What `read_tools` found: the output setup, the tool constraint (None: unconstrained),
    the template variables (`tools`)."""

    setup: OutputSetup | None
    constraint: Constraint | None
    template_kwargs: dict[str, Any]
    keep_special_tokens: bool = False  # the parser's markers are special tokens


def read_tools(req: ChatCompletionRequest, options: ChatOptions, tok: Tokenizer) -> ChatTools:
    reasoning = options.reasoning_parser
    base = OutputSetup(reasoning=reasoning, include_reasoning=req.include_reasoning)
    if req.tools is None:
        if req.tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        _check_history(req, tok, parallel=True)
        return ChatTools(base if reasoning is not None else None, None, {})
    if not req.tools:
        raise bad_request("tools must not be an empty array", "tools")
    tools = function_tools(req.tools)
    choice, named = _choice(req, tools, options)
    parallel = req.parallel_tool_calls is not False
    if choice != "none" and not tok.template_mentions("tools"):
        raise bad_request(
            f"the model's chat template does not render tools; {_TEMPLATE_HINT}", "tools"
        )
    _check_history(req, tok, parallel)
    parser = options.tool_parser if choice == "auto" else None
    special = parser is not None and special_markers(parser, tok)
    setup = OutputSetup(
        tools=tuple(tools),
        tool_choice=choice,
        named=named,
        parallel_tool_calls=parallel,
        parser=parser,
        reasoning=reasoning,
        include_reasoning=req.include_reasoning,
    )
    return ChatTools(
        setup,
        _constraint(setup, tag=not special),
        {"tools": [t.to_openai() for t in tools]},
        keep_special_tokens=special,
    )


def special_markers(parser: type[ToolParser], tok: Tokenizer) -> bool:
    """Whether the parser's call markers are special tokens of this vocabulary (Mistral's
    `[TOOL_CALLS]`, Granite's `<|tool_call|>`): the text must then keep special tokens for
    the parser to see them (vLLM does the same), and no grammar may carry them (grammars
    never emit special tokens), so such a format's calls are parsed, not constrained."""
    for marker in getattr(parser, "MARKERS", ()):
        try:
            if tok.is_special(tok.token_id(marker)):
                return True
        except KeyError:
            pass
    return False


def function_tools(declared: list[ChatTool]) -> list[FunctionTool]:
    """A request's `tools`, checked: function tools, each name once, object schemas."""
    tools, seen = [], set()
    for i, tool in enumerate(declared):
        if tool.type != "function":
            raise bad_request(
                f"tools.{i}.type: {tool.type!r} tools are not supported (only function tools)",
                f"tools.{i}.type",
            )
        f = tool.function
        if f is None:
            raise bad_request(f"tools.{i}.function is required", f"tools.{i}.function")
        if f.name in seen:
            raise bad_request(
                f"tools.{i}.function.name: {f.name!r} is declared twice", f"tools.{i}.function.name"
            )
        seen.add(f.name)
        if f.parameters is not None and f.parameters.get("type", "object") != "object":
            raise bad_request(
                f"tools.{i}.function.parameters must be a JSON schema of an object",
                f"tools.{i}.function.parameters",
            )
        tools.append(FunctionTool(f.name, f.description, f.parameters, f.strict))
    return tools


def _choice(
    req: ChatCompletionRequest, tools: list[FunctionTool], options: ChatOptions
) -> tuple[ToolChoice, str | None]:
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.name for t in tools}:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not among the tools",
                "tool_choice",
            )
        return "function", name
    if choice == "auto" and not (options.auto_tool_choice and options.tool_parser):
        raise bad_request(
            '"auto" tool choice (the default when tools are given) needs the '
            "server's --enable-auto-tool-choice and --tool-call-parser; use "
            'tool_choice "required", a named function, or "none"',
            "tool_choice",
        )
    return choice, None


def _constraint(setup: OutputSetup, tag: bool) -> Constraint | None:
    tools = list(setup.tools)
    if setup.tool_choice == "function":
        tool = next(t for t in tools if t.name == setup.named)
        return Constraint(
            StructuredOutputsParams(
                json=tool.parameters or {"type": "object"}, disable_any_whitespace=True
            ),
            "tool_choice",
        )
    if setup.tool_choice == "required":
        schema = required_calls_schema(tools, setup.parallel_tool_calls)
        return Constraint(
            StructuredOutputsParams(json=schema, disable_any_whitespace=True), "tools"
        )
    if setup.tool_choice == "auto" and setup.parser is not None and tag:
        structural = setup.parser.structural_tag(tools)
        if structural is not None:
            return Constraint(
                StructuredOutputsParams(structural_tag=json.dumps(structural)), "tools"
            )
    return None


def _check_history(req: ChatCompletionRequest, tok: Tokenizer, parallel: bool) -> None:
    """Earlier tool turns: the template must render them; parallel_tool_calls false allows
    one call per assistant turn."""
    for i, m in enumerate(req.messages):
        if m.tool_calls:
            if not tok.template_mentions("tool_calls"):
                raise bad_request(
                    f"messages.{i}.tool_calls: the model's chat template does not "
                    f"render tool calls; {_TEMPLATE_HINT}",
                    f"messages.{i}.tool_calls",
                )
            if not parallel and len(m.tool_calls) > 1:
                raise bad_request(
                    f"messages.{i}.tool_calls has {len(m.tool_calls)} calls but "
                    "parallel_tool_calls is false",
                    f"messages.{i}.tool_calls",
                )
            if m.role != "assistant":
                raise bad_request(
                    f"messages.{i}.tool_calls: only assistant messages make calls",
                    f"messages.{i}.tool_calls",
                )
        if m.role == "tool" and not tok.template_mentions("tool"):
            raise bad_request(
                f"messages.{i}: the model's chat template does not render tool "
                f"results (role 'tool'); {_TEMPLATE_HINT}",
                f"messages.{i}.role",
            )


def combine(tools: ChatTools, other: Constraint | None) -> Constraint | None:
    """The request's one constraint: the tool calls' or another field's, never both."""
    if tools.constraint is not None and other is not None:
        choice = tools.setup.tool_choice if tools.setup else "none"
        raise bad_request(
            f"{other.param} cannot be combined with tools under tool_choice "
            f"{choice!r}: the output cannot follow both",
            other.param,
        )
    return tools.constraint or other
