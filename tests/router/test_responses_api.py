"""POST /v1/responses (router/responses_api/): the request's conversion into a chat request,
the output items and streaming events built from parsed pieces of model text (hand-made
`ParsedDelta`s), the response store, the refusals, and the route through a router with fake
workers, streamed and not, every body and event validated against router/response_models.py."""
import json
from pathlib import Path

import httpx
import openai
import pytest

from engine.sampling_params import SamplingParams
from router.chat_output import OutputSetup
from router.dispatch import Delta
from router.reasoning import reasoning_parser
from router.errors import APIError
from router.protocol import ChatCompletionRequest
from router.response_models import ResponsesResponse, ResponseStreamEvent
from router.responses_api.convert import chat_body, input_messages, output_messages, renamed
from router.responses_api.output import OutputWriter
from router.responses_api.protocol import check, parse_request
from router.responses_api.routes import _history
from router.responses_api.run import ResponseRun
from router.responses_api.store import ResponseStore
from router.tools.types import ParsedDelta, ToolCallDelta
from router.validation import Prepared
from router_fakes import fake_token
from router_harness import start_cluster

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = str(Path(__file__).resolve().parents[2] / "examples" / "tool_chat_template_chatml.jinja")
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}


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
    assert chat["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}]
    assert chat["model"] == MODEL and chat["stream"] is False


def test_message_items_and_parts():
    chat = converted(input=[
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]}])
    assert chat["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}]}]


def test_function_calls_and_their_outputs():
    chat = converted(input=[
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "call_a", "name": "weather", "arguments": '{"c":"Paris"}'},
        {"type": "function_call", "call_id": "call_b", "name": "weather", "arguments": '{"c":"Rome"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sun"},
        {"type": "function_call_output", "call_id": "call_b", "output": "rain"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "call_c", "name": "time", "arguments": "{}"}])
    call = lambda i, c: {"id": i, "type": "function", "function": {"name": "weather",
                                                                   "arguments": f'{{"c":"{c}"}}'}}
    assert chat["messages"] == [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [call("call_a", "Paris"), call("call_b", "Rome")]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sun"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
        # reasoning opens the next turn; its call joins it
        {"role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [
            {"id": "call_c", "type": "function", "function": {"name": "time", "arguments": "{}"}}]}]


def test_tools_choice_and_sampling_fields():
    tool = {"type": "function", "name": "weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {"c": {"type": "string"}}},
            "strict": True}
    chat = converted(input="x", tools=[tool, {"type": "function", "name": "t"}],
                     tool_choice={"type": "function", "name": "weather"},
                     parallel_tool_calls=False, max_output_tokens=7, temperature=0.5, top_p=0.9,
                     user="u", stop=["\n"], seed=3, top_k=5, stream=True)
    assert chat["tools"] == [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}},
        {"type": "function", "function": {"name": "t"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert (chat["parallel_tool_calls"], chat["max_completion_tokens"], chat["temperature"],
            chat["top_p"], chat["user"], chat["stop"], chat["seed"], chat["top_k"],
            chat["stream"]) == (False, 7, 0.5, 0.9, "u", ["\n"], 3, 5, True)
    assert "max_tokens" not in chat and "response_format" not in chat
    for choice in ("none", "auto", "required"):
        assert converted(input="x", tools=[tool], tool_choice=choice)["tool_choice"] == choice


def test_text_format_is_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = converted(input="x", text={"format": {"type": "json_schema", "name": "A",
                                                 "schema": schema, "strict": True}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "A", "schema": schema, "strict": True}}
    assert converted(input="x", text={"format": {"type": "json_object"}})["response_format"] \
        == {"type": "json_object"}
    assert "response_format" not in converted(input="x", text={"format": {"type": "text"}})


def test_output_becomes_an_assistant_turn():
    w = OutputWriter()
    w.add(ParsedDelta(reasoning="think", content="Sure."))
    w.add(ParsedDelta(tool_calls=[ToolCallDelta(0, "call_1", "f", '{"x": 1}')]))
    w.close()
    assert output_messages(w.output()) == [{"role": "assistant", "content": [
        {"type": "text", "text": "Sure."}], "reasoning_content": "think", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]


def test_chat_refusals_name_the_responses_fields():
    cases = [("max_completion_tokens", "Reduce max_completion_tokens.", "max_output_tokens",
              "Reduce max_output_tokens."),
             ("messages.3.content", "messages.3.content: bad; your messages has 9 tokens",
              "input", "input: bad; your input has 9 tokens"),
             ("tools.1.function.parameters", "tools.1.function.parameters: not a schema",
              "tools.1.parameters", "tools.1.parameters: not a schema"),
             ("tool_choice.function.name", "unknown", "tool_choice.name", "unknown"),
             ("response_format.json_schema.schema", "bad", "text.format.schema", "bad"),
             ("temperature", "temperature must be >= 0", "temperature", "temperature must be >= 0")]
    for param, message, want_param, want_message in cases:
        out = renamed(APIError(400, message, param, "c"))
        assert (out.status, out.param, out.message, out.code) == (400, want_param, want_message, "c")


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "frequency_penalty": 1}, "frequency_penalty", "unknown or unsupported field"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "'web_search'"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "x": 1}]}, "tools.0.x", "unknown"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "truncation": "auto"}, "truncation", "'auto' is not supported"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort", "not supported"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary", "not supported"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include.0", "encrypted"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input.0.type", "'function_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input.0.content.0.type", "'input_image'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id",
     "Field required"),
    ({"input": 5}, "input", "none of the accepted types"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type", "'json_schema'"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice.type", "'web_search'"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"input": "x", "stream": "yes"}, "stream", "boolean"),
])
def test_refusals_name_the_field(body, param, words):
    with pytest.raises(APIError) as caught:
        check(request(**body))
    exc = caught.value
    assert (exc.status, exc.param) == (400, param) and words in exc.message, exc.message


def test_previous_response_id_needs_the_store():
    with pytest.raises(APIError) as caught:
        _history(None, None, "resp_1")
    assert caught.value.status == 400 and "--enable-response-store" in caught.value.message
    assert caught.value.param == "previous_response_id"
    with pytest.raises(APIError) as caught:
        _history(ResponseStore(4, 1 << 20), None, "resp_1")
    assert caught.value.status == 404 and caught.value.param == "previous_response_id"
    assert _history(None, None, None) == []


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
    assert types == ["output_item.added", "content_part.added", "output_text.delta",
                     "output_text.delta", "output_text.done", "content_part.done",
                     "output_item.done"]
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
    w = run_writer([
        ParsedDelta(content="On it."),
        ParsedDelta(tool_calls=[ToolCallDelta(0, "call_1", "weather", '{"c": ')]),
        ParsedDelta(tool_calls=[ToolCallDelta(0, arguments='"Paris"}'),
                                ToolCallDelta(1, "call_2", "time", "")]),
        ParsedDelta(tool_calls=[ToolCallDelta(1, arguments="{}")])])
    types = [e["type"].removeprefix("response.") for e in w.events]
    message = ["output_item.added", "content_part.added", "output_text.delta",
               "output_text.done", "content_part.done", "output_item.done"]
    assert types == message + [
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done"]
    msg, first, second = w.output()
    assert [first[k] for k in ("type", "call_id", "name", "arguments", "status")] == [
        "function_call", "call_1", "weather", '{"c": "Paris"}', "completed"]
    assert (second["call_id"], second["name"], second["arguments"]) == ("call_2", "time", "{}")
    for item in (first, second):
        mine = [e for e in w.events if e.get("item_id") == item["id"]]
        assert "".join(e["delta"] for e in mine if e["type"].endswith("arguments.delta")) \
            == mine[-1]["arguments"] == item["arguments"]
        assert mine[-1]["name"] == item["name"]
    assert [e["output_index"] for e in w.events if e["type"].endswith("item.added")] == [0, 1, 2]
    added = next(e for e in w.events if e["type"].endswith("item.added")
                 and e["item"]["type"] == "function_call")
    assert added["item"] == {**first, "arguments": "", "status": "in_progress"}


def test_reasoning_events():
    w = run_writer([ParsedDelta(reasoning="Let me "), ParsedDelta(reasoning="think."),
                    ParsedDelta(reasoning="", content="42")])
    types = [e["type"].removeprefix("response.") for e in w.events]
    assert types == ["output_item.added", "content_part.added", "reasoning_text.delta",
                     "reasoning_text.delta", "reasoning_text.done", "content_part.done",
                     "output_item.done", "output_item.added", "content_part.added",
                     "output_text.delta", "output_text.done", "content_part.done",
                     "output_item.done"]
    reasoning, message = w.output()
    assert reasoning == {"type": "reasoning", "id": reasoning["id"], "summary": [],
                         "content": [{"type": "reasoning_text", "text": "Let me think."}],
                         "status": "completed"}
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
    deltas = [ParsedDelta(reasoning="r"), ParsedDelta(content="c"),
              ParsedDelta(tool_calls=[ToolCallDelta(0, "call_1", "f", "{}")])]
    quiet = OutputWriter()
    for d in deltas:
        quiet.add(d)
    quiet.close()
    strip = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]
    assert quiet.events is None and strip(quiet.output()) == strip(run_writer(deltas).output())


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
    return Prepared(kind="chat", model=MODEL, prompts=[[1, 2, 3, 4]],
                    sampling=SamplingParams(max_tokens=4, temperature=0.5), cache_salt=None,
                    stream=stream, include_usage=False, output=output)


def scripted_run(req, stream, pieces, response_id, stored, details):
    run = ResponseRun(req, prepared(stream), response_id, stored, details)
    run.parser = Scripted(pieces)
    return run


def sse_events(raw: bytes):
    """(event name, data) of each event; checks the framing."""
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_run_streams_valid_events_and_counts_reasoning_tokens():
    req = request(input="x", max_output_tokens=4, metadata={"k": "v"},
                  tools=[{"type": "function", "name": "f"}], stream=True)
    pieces = [ParsedDelta(reasoning="hmm"), ParsedDelta(), ParsedDelta(content="ok"),
              ParsedDelta(tool_calls=[ToolCallDelta(0, "call_1", "f", "{}")])]
    run = scripted_run(req, True, pieces, "resp_1", True, False)
    deltas = [Delta(0, [9], t, [], None, 2) for t in "abc"] + [Delta(0, [9], "d", [], "length", 2)]
    run.add(0, deltas[0])
    raw = run.opening() + run.take()
    for d in deltas[1:]:
        run.add(0, d)
        raw += run.take()
    raw += run.closing()
    events = sse_events(raw)
    for name, data in events:
        assert name == data["type"]
        ResponseStreamEvent.model_validate(data)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert [name for name, _ in events][:2] == ["response.created", "response.in_progress"]
    name, last = events[-1]
    assert name == "response.incomplete"
    body = ResponsesResponse.model_validate(last["response"])
    assert body.status == "incomplete" and body.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in body.output] == ["reasoning", "message", "function_call"]
    assert body.output[-1].status == "incomplete"  # cut off while it was open
    assert body.usage.model_dump() == {
        "input_tokens": 4, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 8}
    assert (body.metadata, body.temperature, body.max_output_tokens, body.store) == (
        {"k": "v"}, 0.5, 4, True)
    assert body.tools[0].model_dump() == {"type": "function", "name": "f", "description": None,
                                          "parameters": None, "strict": None}


def test_run_failure_event():
    run = scripted_run(request(input="x"), True, [ParsedDelta(content="a")], "resp_2", False,
                       True)
    run.add(0, Delta(0, [5], "a", [], None, 3))
    events = sse_events(run.opening() + run.take() + run.failed("workers failed"))
    name, data = events[-1]
    body = ResponseStreamEvent.model_validate(data).root.response
    assert name == "response.failed" and body.status == "failed"
    assert body.error.model_dump() == {"code": "server_error", "message": "workers failed"}
    assert body.usage.input_tokens_details.cached_tokens == 3


# ---- the store --------------------------------------------------------------------------------
def turn(text):
    return [{"role": "user", "content": text}]


def test_store_is_a_bounded_lru_per_tenant():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    store.put(None, "a", turn("1"))
    store.put(None, "b", turn("2"))
    assert store.get(None, "a") == turn("1")  # a is now the most recent
    store.put(None, "c", turn("3"))
    assert store.get(None, "b") is None and len(store) == 2
    assert store.get(None, "a") == turn("1") and store.get(None, "c") == turn("3")
    assert store.get(b"tenant", "a") is None  # another key's responses are unknown
    store.put(b"tenant", "a", turn("4"))
    assert store.get(b"tenant", "a") == turn("4") and store.get(None, "a") is None


def test_store_bounds_the_bytes():
    size = len(json.dumps(turn("x" * 100), separators=(",", ":")))
    store = ResponseStore(max_entries=100, max_bytes=2 * size + 1)
    for key in "abc":
        store.put(None, key, turn("x" * 100))
    assert store.get(None, "a") is None and len(store) == 2 and store.bytes == 2 * size
    store.put(None, "huge", turn("x" * 1000))  # larger than the whole store: not kept
    assert store.get(None, "huge") is None and len(store) == 2


# ---- the route, fake workers ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(bg, etcd.endpoint, "responses", [("decode", "d1")],
                      enable_response_store=True, chat_template=TEMPLATE,
                      enable_auto_tool_choice=True, tool_call_parser="hermes",
                      reasoning_parser="qwen3")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.router.url, timeout=30) as c:
        yield c


def post(http, body):
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    return ResponsesResponse.model_validate_json(r.content)


def stream(http, body):
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read())
    for name, data in events:
        assert name == data["type"]
        ResponseStreamEvent.model_validate(data)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return events


def expected_words(cluster, messages, n):
    tok = cluster.services.card.tokenizer
    prompt = tok.encode(tok.render_chat(messages))
    return "".join(f" w{fake_token(prompt, 0, k)}" for k in range(n))


def test_route_answers_whole_and_streamed(cluster, http):
    body = {"model": MODEL, "input": "Hello", "instructions": "Be brief.", "max_output_tokens": 3}
    words = expected_words(cluster, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hello"}], 3)
    whole = post(http, body)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    [message] = whole.output
    assert message.type == "message" and message.content[0].text == words
    assert whole.usage.output_tokens == 3 and whole.usage.total_tokens == \
        whole.usage.input_tokens + 3
    events = stream(http, body)
    kinds = [name for name, _ in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == words
    final = ResponsesResponse.model_validate(events[-1][1]["response"])
    assert final.output[0].content[0].text == words and final.usage == whole.usage
    # a stop string ends it: completed
    stop = post(http, {**body, "max_output_tokens": 5, "stop": [words.split(" ")[2]]})
    assert stop.status == "completed" and stop.incomplete_details is None


def test_route_continues_a_stored_response(cluster, http):
    first = post(http, {"model": MODEL, "input": "Hi", "instructions": "Be brief.",
                        "max_output_tokens": 2})
    answer = first.output[0].content[0].text
    events = stream(http, {"model": MODEL, "input": "More", "max_output_tokens": 2,
                           "previous_response_id": first.id})
    second = ResponsesResponse.model_validate(events[-1][1]["response"])
    assert second.previous_response_id == first.id and second.store
    tok = cluster.services.card.tokenizer
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": "More"}]  # instructions are not carried over
    sent = cluster.workers["d1"].requests[-1].prompt_token_ids
    assert list(sent) == tok.encode(tok.render_chat(conversation))
    third = post(http, {"model": MODEL, "input": "Again", "max_output_tokens": 1,
                        "previous_response_id": second.id, "store": False})
    assert not third.store
    r = http.post("/v1/responses", json={"input": "x", "previous_response_id": third.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_route_refusals(http):
    for body, param in [({"input": "x", "temperature": -1}, "temperature"),
                        ({"input": "x", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
                        ({"input": "x", "model": "other"}, "model"),
                        ({"input": "x", "background": True}, "background"),
                        ({"input": "x", "service_tier": "auto"}, "service_tier")]:
        r = http.post("/v1/responses", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    r = http.post("/v1/responses", json={"input": "x", "max_output_tokens": 10 ** 6})
    assert "max_completion_tokens" not in r.text


def test_openai_client(cluster):
    """The official client reads the bodies and events (its stream helper accumulates them)."""
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    words = expected_words(cluster, [{"role": "user", "content": "Hello"}], 3)
    response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    assert response.output_text == words[:words.rindex(" ")] and response.status == "incomplete"
    stop = {"stop": [" " + words.split(" ")[3]]}  # the third word: completed after two
    with client.responses.stream(model=MODEL, input="Hello", max_output_tokens=5,
                                 extra_body=stop) as events:
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        final = events.get_final_response()
    assert text == final.output_text == response.output_text and final.status == "completed"


def test_route_stream_failing_after_the_first_token(cluster, http):
    """Workers failing mid-stream (no other worker to migrate to): `response.failed`, with the
    output so far; nothing is stored."""
    behavior = cluster.workers["d1"].behavior
    behavior.fail_after_tokens = 2
    try:
        events = stream(http, {"model": MODEL, "input": "Fail", "max_output_tokens": 5})
    finally:
        behavior.fail_after_tokens = None
    name, data = events[-1]
    failed = ResponsesResponse.model_validate(data["response"])
    assert name == "response.failed" and failed.status == "failed"
    assert failed.error.code == "server_error" and failed.usage.output_tokens == 2
    assert failed.output[0].content[0].text == "".join(
        d["delta"] for n, d in events if n == "response.output_text.delta")
    r = http.post("/v1/responses", json={"input": "x", "previous_response_id": failed.id})
    assert r.status_code == 404


# ---- through chat's parser: tool calls (fake workers), reasoning ---------------------------
@pytest.fixture
def say(cluster):
    """Makes the fake worker write `text` (in 3-character tokens, ending as the model's EOS)."""
    behavior = cluster.workers["d1"].behavior

    def say(text: str) -> None:
        behavior.script = [(100 + i, text[i:i + 3]) for i in range(0, len(text), 3)]
        behavior.script_finish, behavior.default_max_tokens = "stop", len(behavior.script)
    yield say
    behavior.script, behavior.script_finish, behavior.default_max_tokens = None, "length", 32


def calls_of(body: ResponsesResponse):
    return [(i.name, json.loads(i.arguments)) for i in body.output if i.type == "function_call"]


def test_a_named_function_call(cluster, http, say):
    say('{"city": "Paris"}')
    body = {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    whole = post(http, body)
    [call] = whole.output
    assert (call.type, call.name, call.arguments, call.status) == (
        "function_call", "get_weather", '{"city": "Paris"}', "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert whole.status == "completed" and whole.tool_choice.name == "get_weather"
    assert [t.name for t in whole.tools] == ["get_weather", "get_time"]
    so = cluster.workers["d1"].requests[-1].sampling.structured_outputs
    assert json.loads(so.json) == WEATHER["parameters"]  # chat's constraint for a named call
    events = stream(http, body)
    kinds = [n.removeprefix("response.") for n, _ in events]
    assert kinds == ["created", "in_progress", "output_item.added"] + \
        ["function_call_arguments.delta"] * 6 + ["function_call_arguments.done",
                                                 "output_item.done", "completed"]
    done = next(d for n, d in events if n == "response.function_call_arguments.done")
    assert "".join(d["delta"] for n, d in events if n.endswith("arguments.delta")) == \
        done["arguments"] == '{"city": "Paris"}' and done["name"] == "get_weather"


def test_required_calls_counted(cluster, http, say):
    def sample(name):
        return cluster.router.services.metrics.registry.get_sample_value(
            name, {"tool_choice": "required"}) or 0

    before = sample("pdserve_router_tool_requests_total"), sample("pdserve_router_tool_calls_total")
    say('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {"tz": "CET"}}]')
    body = {"model": MODEL, "input": "Weather and time?", "tools": [WEATHER, TIME],
            "tool_choice": "required"}
    expected = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert calls_of(post(http, body)) == expected
    events = stream(http, body)
    final = ResponsesResponse.model_validate(events[-1][1]["response"])
    assert calls_of(final) == expected and final.status == "completed"
    assert [d["output_index"] for n, d in events if n == "response.output_item.added"] == [0, 1]
    after = sample("pdserve_router_tool_requests_total"), sample("pdserve_router_tool_calls_total")
    assert (after[0] - before[0], after[1] - before[1]) == (2, 4)


def test_a_call_and_its_output_continue_the_conversation(cluster, http, say):
    """Turn 1 calls a function; turn 2 sends its output with previous_response_id: the
    prompt renders the call and the result through the template."""
    say('{"city": "Paris"}')
    first = post(http, {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER],
                        "tool_choice": {"type": "function", "name": "get_weather"}})
    [call] = first.output
    say("It is sunny.")
    second = post(http, {"model": MODEL, "previous_response_id": first.id, "tools": [WEATHER],
                         "tool_choice": "none", "input": [
                             {"type": "function_call_output", "call_id": call.call_id,
                              "output": "sunny, 21 C"}]})
    assert second.output[0].content[0].text == "It is sunny."
    tok = cluster.services.card.tokenizer
    prompt = tok.decode(list(cluster.workers["d1"].requests[-1].prompt_token_ids))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in prompt and "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    # the same turn with the call sent back as input instead: the same prompt
    post(http, {"model": MODEL, "tools": [WEATHER], "tool_choice": "none", "input": [
        {"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]})
    assert tok.decode(list(cluster.workers["d1"].requests[-1].prompt_token_ids)) == prompt


@pytest.mark.parametrize("extra, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "'nope'"),
    ({"tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "none"},
     "tools.0.name", "tools.0.name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.name", "twice"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format", "text.format"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input", "object"),
])
def test_chat_refusals_name_the_responses_field(cluster, http, extra, param, words):
    before = len(cluster.workers["d1"].requests)
    r = http.post("/v1/responses", json={"model": MODEL, "input": "x", **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert len(cluster.workers["d1"].requests) == before  # no worker saw it


def test_reasoning_through_chats_parser():
    """The run reads text with chat's MessageParser (Prepared.output): reasoning then answer,
    split wherever the pieces fall; reasoning tokens are those whose text was reasoning."""
    req = request(input="x", stream=True)
    run = ResponseRun(req, prepared(True, OutputSetup(reasoning=reasoning_parser("qwen3"))),
                      "resp_3", False, False)
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
    assert "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta") == "Let me"
    assert body.usage.output_tokens_details.reasoning_tokens == 2


def test_auto_reasoning_text_and_calls_in_the_models_format(cluster, http, say):
    """qwen3 reasoning, then answer text, then two hermes calls: one item each, in order,
    whole and streamed the same."""
    say("<think>Two cities.</think>Let me check. <tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    body = {"model": MODEL, "input": "Weather and time?", "tools": [WEATHER, TIME]}  # auto
    whole = post(http, body)
    assert [i.type for i in whole.output] == ["reasoning", "message", "function_call",
                                              "function_call"]
    assert whole.output[0].content[0].text == "Two cities."
    assert whole.output[1].content[0].text == "Let me check. "
    assert calls_of(whole) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert whole.status == "completed" and whole.usage.output_tokens_details.reasoning_tokens > 0
    events = stream(http, body)
    final = ResponsesResponse.model_validate(events[-1][1]["response"])
    strip = lambda r: [i.model_dump(exclude={"id", "call_id"}) for i in r.output]
    assert strip(final) == strip(whole) and final.usage == whole.usage
    text = lambda kind: "".join(d["delta"] for n, d in events if n == f"response.{kind}.delta")
    assert text("reasoning_text") == "Two cities." and text("output_text") == "Let me check. "
    # the turn sent back: reasoning, text and calls are one assistant message
    assert output_messages([i.model_dump() for i in whole.output]) == [{
        "role": "assistant", "content": [{"type": "text", "text": "Let me check. "}],
        "reasoning_content": "Two cities.", "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name,
                                                               "arguments": c.arguments}}
            for c in whole.output[2:]]}]
