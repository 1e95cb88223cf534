"""POST /v1/responses (router/endpoints/responses/), its parts: the request's conversion into a chat
request, the refusals, the output items and streaming events built from parsed pieces of model
text: test_responses_events.py; the response store: test_response_store.py; the route itself,
with fake workers: test_responses_route.py."""

import json
import logging

import pytest

from router.endpoints.chat.protocol import ChatCompletionRequest
from router.endpoints.responses.convert import chat_body, input_messages, output_messages, renamed
from router.endpoints.responses.output import OutputWriter
from router.endpoints.responses.protocol import check, parse_request
from router.http.errors import APIError
from router.parsers.tools.types import ParsedDelta, ToolCallDelta

MODEL = "SmolLM2-135M-Instruct"


def request(**body):
    return parse_request(json.dumps(body).encode())


def converted(**body):
    req = request(**body)
    chat = chat_body(req, input_messages(req.input))
    ChatCompletionRequest.model_validate(chat)  # chat's own model takes it
    return chat


# ---- conversion -------------------------------------------------------------------------------
def test_input_string_and_instructions():
    chat = converted(model=MODEL, input="hi", instructions="Be brief.")
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert chat["model"] == MODEL and chat["stream"] is False


def test_message_items_and_parts():
    chat = converted(
        input=[
            {"role": "developer", "content": "rules"},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                ],
            },
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "c", "annotations": []}],
            },
        ]
    )
    assert chat["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}]},
    ]


def test_function_calls_and_their_outputs():
    chat = converted(
        input=[
            {"role": "user", "content": "weather in Paris and Rome?"},
            {"role": "assistant", "content": "Checking."},
            {
                "type": "function_call",
                "call_id": "call_a",
                "name": "weather",
                "arguments": '{"c":"Paris"}',
            },
            {
                "type": "function_call",
                "call_id": "call_b",
                "name": "weather",
                "arguments": '{"c":"Rome"}',
                "id": "fc_1",
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_a", "output": "sun"},
            {"type": "function_call_output", "call_id": "call_b", "output": "rain"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hmm"}],
            },
            {"type": "function_call", "call_id": "call_c", "name": "time", "arguments": "{}"},
        ]
    )

    def call(i, c):
        return {
            "id": i,
            "type": "function",
            "function": {"name": "weather", "arguments": f'{{"c":"{c}"}}'},
        }

    assert chat["messages"] == [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [call("call_a", "Paris"), call("call_b", "Rome")],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "sun"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
        # reasoning opens the next turn; its call joins it
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "hmm",
            "tool_calls": [
                {
                    "id": "call_c",
                    "type": "function",
                    "function": {"name": "time", "arguments": "{}"},
                }
            ],
        },
    ]


def test_tools_choice_and_sampling_fields():
    tool = {
        "type": "function",
        "name": "weather",
        "description": "Weather now",
        "parameters": {"type": "object", "properties": {"c": {"type": "string"}}},
        "strict": True,
    }
    chat = converted(
        input="x",
        tools=[tool, {"type": "function", "name": "t"}],
        tool_choice={"type": "function", "name": "weather"},
        parallel_tool_calls=False,
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        user="u",
        stop=["\n"],
        seed=3,
        top_k=5,
        stream=True,
    )
    assert chat["tools"] == [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}},
        {"type": "function", "function": {"name": "t"}},
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert (
        chat["parallel_tool_calls"],
        chat["max_completion_tokens"],
        chat["temperature"],
        chat["top_p"],
        chat["user"],
        chat["stop"],
        chat["seed"],
        chat["top_k"],
        chat["stream"],
    ) == (False, 7, 0.5, 0.9, "u", ["\n"], 3, 5, True)
    assert "max_tokens" not in chat and "response_format" not in chat
    for choice in ("none", "auto", "required"):
        assert converted(input="x", tools=[tool], tool_choice=choice)["tool_choice"] == choice


def test_text_format_is_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = converted(
        input="x",
        text={"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}},
    )
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "A", "schema": schema, "strict": True},
    }
    assert converted(input="x", text={"format": {"type": "json_object"}})["response_format"] == {
        "type": "json_object"
    }
    assert "response_format" not in converted(input="x", text={"format": {"type": "text"}})


def test_output_becomes_an_assistant_turn():
    w = OutputWriter()
    w.add(ParsedDelta(reasoning="think", content="Sure."))
    w.add(ParsedDelta(tool_calls=[ToolCallDelta(0, "call_1", "f", '{"x": 1}')]))
    w.close()
    assert output_messages(w.output()) == [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Sure."}],
            "reasoning_content": "think",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 1}'},
                }
            ],
        }
    ]


def test_chat_refusals_name_the_responses_fields():
    cases = [
        (
            "max_completion_tokens",
            "Reduce max_completion_tokens.",
            "max_output_tokens",
            "Reduce max_output_tokens.",
        ),
        (
            "messages.3.content",
            "messages.3.content: bad; your messages has 9 tokens",
            "input",
            "input: bad; your input has 9 tokens",
        ),
        (
            "tools.1.function.parameters",
            "tools.1.function.parameters: not a schema",
            "tools.1.parameters",
            "tools.1.parameters: not a schema",
        ),
        ("tool_choice.function.name", "unknown", "tool_choice.name", "unknown"),
        ("response_format.json_schema.schema", "bad", "text.format.schema", "bad"),
        ("temperature", "temperature must be >= 0", "temperature", "temperature must be >= 0"),
    ]
    for param, message, want_param, want_message in cases:
        out = renamed(APIError(400, message, param, "c"))
        assert (out.status, out.param, out.message, out.code) == (
            400,
            want_param,
            want_message,
            "c",
        )


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": "x", "frequency_penalty": 1}, "frequency_penalty", "unsupported field"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs", "unsupported field"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "'web_search'"),
        ({"input": "x", "background": True}, "background", "background"),
        ({"input": "x", "truncation": "auto"}, "truncation", "'auto' is not supported"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort", "not supported"),
        ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary", "not supported"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include.0", "encrypted"),
        ({"input": [{"type": "web_search_call", "id": "w"}]}, "input.0.type", "'function_call'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input.0.content.0.type",
            "'input_image'",
        ),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input.0.call_id",
            "Field required",
        ),
        ({"input": 5}, "input", "none of the accepted types"),
        (
            {"input": "x", "text": {"format": {"type": "grammar"}}},
            "text.format.type",
            "'json_schema'",
        ),
        ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice.type", "'web_search'"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"input": "x", "stream": "yes"}, "stream", "boolean"),
    ],
)
def test_refusals_name_the_field(body, param, words):
    with pytest.raises(APIError) as caught:
        check(request(**body))
    exc = caught.value
    assert (exc.status, exc.param) == (400, param) and words in exc.message, exc.message


def test_unknown_fields_are_ignored_with_a_warning(caplog):
    """The one policy of every request body (router/endpoints/base.py), as vLLM: an unknown
    field, at the top or inside an item, is ignored with a warning naming it (a known field
    this endpoint does not act on is refused: test_refusals_name_the_field)."""
    with caplog.at_level(logging.WARNING, logger="router.endpoints.base"):
        req = request(
            input="x",
            frobnicate_top=1,
            tools=[{"type": "function", "name": "f", "frobnicate_tool": 1}],
        )
        check(req)
    assert req.tools[0].name == "f"
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "frobnicate_top" in logged and "frobnicate_tool" in logged
