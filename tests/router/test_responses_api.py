"""POST /v1/responses (router/endpoints/responses/), its parts: the request's conversion into a chat
request, the refusals, the output items and streaming events built from parsed pieces of model
text (hand-made `ParsedDelta`s, and chat's own parser). The response store:
test_response_store.py; the route itself, with fake workers: test_responses_route.py."""

import json
import logging

import pytest
from api_fuzz import response_events

from engine.sampling.sampling_params import SamplingParams
from router.call import Delta
from router.endpoints.chat.protocol import ChatCompletionRequest
from router.endpoints.responses.convert import chat_body, input_messages, output_messages, renamed
from router.endpoints.responses.objects import ResponsesResponse, ResponseStreamEvent
from router.endpoints.responses.output import OutputWriter
from router.endpoints.responses.protocol import check, parse_request
from router.endpoints.responses.run import ResponseRun
from router.generation.prepare import Prepared
from router.http.errors import APIError
from router.parsers.message import OutputSetup
from router.parsers.reasoning.parser import reasoning_parser
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


# ---- output items and events ------------------------------------------------------------------
def run_writer(deltas, incomplete=False):
    w = OutputWriter(events=True)
    for d in deltas:
        w.add(d)
    w.close(incomplete)
    return w


def test_text_answer_events():
    w = run_writer([ParsedDelta(content="Hel"), ParsedDelta(), ParsedDelta(content="lo!")])
    types = [e["type"].removeprefix("response.") for e in w.events]
    assert types == [
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
    ]
    [item] = w.output()
    assert item["type"] == "message" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Hello!", "annotations": []}]
    deltas = "".join(e["delta"] for e in w.events if e["type"] == "response.output_text.delta")
    done = next(e for e in w.events if e["type"] == "response.output_text.done")
    assert deltas == done["text"] == "Hello!"
    assert w.events[0]["item"] == {**item, "status": "in_progress", "content": []}
    assert w.events[-1]["item"] == item
    assert {e.get("item_id", e.get("item", {}).get("id")) for e in w.events} == {item["id"]}


def test_function_call_events():
    w = run_writer(
        [
            ParsedDelta(content="On it."),
            ParsedDelta(tool_calls=[ToolCallDelta(0, "call_1", "weather", '{"c": ')]),
            ParsedDelta(
                tool_calls=[
                    ToolCallDelta(0, arguments='"Paris"}'),
                    ToolCallDelta(1, "call_2", "time", ""),
                ]
            ),
            ParsedDelta(tool_calls=[ToolCallDelta(1, arguments="{}")]),
        ]
    )
    types = [e["type"].removeprefix("response.") for e in w.events]
    message = [
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
    ]
    assert types == message + [
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
    ]
    msg, first, second = w.output()
    assert [first[k] for k in ("type", "call_id", "name", "arguments", "status")] == [
        "function_call",
        "call_1",
        "weather",
        '{"c": "Paris"}',
        "completed",
    ]
    assert (second["call_id"], second["name"], second["arguments"]) == ("call_2", "time", "{}")
    for item in (first, second):
        mine = [e for e in w.events if e.get("item_id") == item["id"]]
        assert (
            "".join(e["delta"] for e in mine if e["type"].endswith("arguments.delta"))
            == mine[-1]["arguments"]
            == item["arguments"]
        )
        assert mine[-1]["name"] == item["name"]
    assert [e["output_index"] for e in w.events if e["type"].endswith("item.added")] == [0, 1, 2]
    added = next(
        e
        for e in w.events
        if e["type"].endswith("item.added") and e["item"]["type"] == "function_call"
    )
    assert added["item"] == {**first, "arguments": "", "status": "in_progress"}


def test_reasoning_events():
    w = run_writer(
        [
            ParsedDelta(reasoning="Let me "),
            ParsedDelta(reasoning="think."),
            ParsedDelta(reasoning="", content="42"),
        ]
    )
    types = [e["type"].removeprefix("response.") for e in w.events]
    assert types == [
        "output_item.added",
        "content_part.added",
        "reasoning_text.delta",
        "reasoning_text.delta",
        "reasoning_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
    ]
    reasoning, message = w.output()
    assert reasoning == {
        "type": "reasoning",
        "id": reasoning["id"],
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Let me think."}],
        "status": "completed",
    }
    assert reasoning["id"].startswith("rs_") and message["id"].startswith("msg_")
    assert message["content"][0]["text"] == "42"
    assert w.events[1]["part"] == {"type": "reasoning_text", "text": ""}


def test_empty_and_incomplete_outputs():
    w = run_writer([])
    [item] = w.output()
    assert item["content"][0]["text"] == "" and item["status"] == "completed"
    assert [e["type"] for e in w.events][-1] == "response.output_item.done"
    w = run_writer([ParsedDelta(reasoning="a"), ParsedDelta(content="b")], incomplete=True)
    assert [i["status"] for i in w.output()] == ["completed", "incomplete"]


def test_items_are_the_same_without_events():
    deltas = [
        ParsedDelta(reasoning="r"),
        ParsedDelta(content="c"),
        ParsedDelta(tool_calls=[ToolCallDelta(0, "call_1", "f", "{}")]),
    ]
    quiet = OutputWriter()
    for d in deltas:
        quiet.add(d)
    quiet.close()

    def strip(items):
        return [{k: v for k, v in i.items() if k != "id"} for i in items]

    assert quiet.events == [] and strip(quiet.output()) == strip(run_writer(deltas).output())


# ---- a run: deltas -> the response and its SSE events -----------------------------------------
class Scripted:
    """A parser returning hand-made pieces, one per text fed (what chat's parser would)."""

    num_calls = 0

    def __init__(self, pieces):
        self.pieces = list(pieces)

    def feed(self, text):
        return self.pieces.pop(0)

    def finish(self):
        return ParsedDelta()


def prepared(stream, output=None):
    return Prepared(
        kind="chat",
        model=MODEL,
        prompts=[[1, 2, 3, 4]],
        sampling=SamplingParams(max_tokens=4, temperature=0.5),
        cache_salt=None,
        stream=stream,
        include_usage=False,
        output=output,
    )


def scripted_run(req, stream, pieces, response_id, stored, details):
    run = ResponseRun(req, prepared(stream), response_id, stored, details)
    run.parser = Scripted(pieces)
    return run


def sse_events(raw: bytes):
    """(name, data) of each event, each checked: framing, name, number, model."""
    return response_events(raw.decode())


def test_run_streams_valid_events_and_counts_reasoning_tokens():
    req = request(
        input="x",
        max_output_tokens=4,
        metadata={"k": "v"},
        tools=[{"type": "function", "name": "f"}],
        stream=True,
    )
    pieces = [
        ParsedDelta(reasoning="hmm"),
        ParsedDelta(),
        ParsedDelta(content="ok"),
        ParsedDelta(tool_calls=[ToolCallDelta(0, "call_1", "f", "{}")]),
    ]
    run = scripted_run(req, True, pieces, "resp_1", True, False)
    deltas = [Delta(0, [9], t, [], None, 2) for t in "abc"] + [Delta(0, [9], "d", [], "length", 2)]
    run.add(0, deltas[0])
    raw = run.opening() + run.take()
    for d in deltas[1:]:
        run.add(0, d)
        raw += run.take()
    raw += run.closing()
    events = sse_events(raw)
    assert [name for name, _ in events][:2] == ["response.created", "response.in_progress"]
    name, last = events[-1]
    assert name == "response.incomplete"
    body = ResponsesResponse.model_validate(last["response"])
    assert body.status == "incomplete" and body.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in body.output] == ["reasoning", "message", "function_call"]
    assert body.output[-1].status == "incomplete"  # cut off while it was open
    assert body.usage.model_dump() == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 8,
    }
    assert (body.metadata, body.temperature, body.max_output_tokens, body.store) == (
        {"k": "v"},
        0.5,
        4,
        True,
    )
    assert body.tools[0].model_dump() == {
        "type": "function",
        "name": "f",
        "description": None,
        "parameters": None,
        "strict": None,
    }


def test_run_failure_event():
    run = scripted_run(request(input="x"), True, [ParsedDelta(content="a")], "resp_2", False, True)
    run.add(0, Delta(0, [5], "a", [], None, 3))
    events = sse_events(run.opening() + run.take() + run.failed("workers failed"))
    name, data = events[-1]
    body = ResponseStreamEvent.model_validate(data).root.response
    assert name == "response.failed" and body.status == "failed"
    assert body.error.model_dump() == {"code": "server_error", "message": "workers failed"}
    assert body.usage.input_tokens_details.cached_tokens == 3


def test_reasoning_through_chats_parser():
    """The run reads text with chat's MessageParser (Prepared.output): reasoning then answer,
    split wherever the pieces fall; reasoning tokens are those whose text was reasoning."""
    req = request(input="x", stream=True)
    run = ResponseRun(
        req,
        prepared(True, OutputSetup(reasoning=reasoning_parser("qwen3"))),
        "resp_3",
        False,
        False,
    )
    texts = ["<think>Let", " me</th", "ink>The ans", "wer."]
    run.add(0, Delta(0, [1], texts[0], [], None, 0))
    raw = run.opening() + run.take()
    for i, text in enumerate(texts[1:]):
        run.add(0, Delta(0, [2 + i], text, [], "stop" if i == 2 else None, 0))
        raw += run.take()
    events = sse_events(raw + run.closing())
    body = ResponsesResponse.model_validate(events[-1][1]["response"])
    reasoning, message = body.output
    assert reasoning.content[0].text == "Let me" and message.content[0].text == "The answer."
    assert (
        "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta") == "Let me"
    )
    assert body.usage.output_tokens_details.reasoning_tokens == 2


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
