"""POST /v1/responses (router/endpoints/responses/): the output items and streaming events
built from parsed pieces of model text (hand-made `ParsedDelta`s, and chat's own parser), and a
whole `ResponseRun` over scripted deltas. The request's conversion and refusals:
test_responses_api.py."""

import json

from api_fuzz import response_events

from engine.sampling.sampling_params import SamplingParams
from router.call import Delta
from router.endpoints.responses.objects import ResponsesResponse, ResponseStreamEvent
from router.endpoints.responses.output import OutputWriter
from router.endpoints.responses.protocol import parse_request
from router.endpoints.responses.run import ResponseRun
from router.generation.prepare import Prepared
from router.parsers.message import OutputSetup
from router.parsers.reasoning.parser import reasoning_parser
from router.parsers.tools.types import ParsedDelta, ToolCallDelta

MODEL = "SmolLM2-135M-Instruct"


def request(**body):
    return parse_request(json.dumps(body).encode())


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
