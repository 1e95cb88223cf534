"""POST /v1/responses through a router with fake workers (scripted model text), streamed and
not, every body and event validated against router/endpoints/base.py (api_fuzz's reader):
plain answers, previous_response_id through the store, refusals, the official client, a
worker failing mid-stream, and tool calls and reasoning read by chat's parsers (hermes, qwen3)."""

import json
from pathlib import Path

import httpx
import openai
import pytest
from api_fuzz import response_events
from router_fakes import fake_token
from router_harness import start_cluster

from cluster.chat_config import ChatConfig
from router.endpoints.responses.convert import output_messages
from router.endpoints.responses.objects import ResponsesResponse

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = str(Path(__file__).resolve().parents[2] / "examples" / "tool_chat_template_chatml.jinja")
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(
        bg,
        etcd.endpoint,
        "responses",
        [("decode", "d1")],
        enable_response_store=True,
        chat=ChatConfig(
            chat_template=TEMPLATE,
            enable_auto_tool_choice=True,
            tool_call_parser="hermes",
            reasoning_parser="qwen3",
        ),
    )
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
    """Every event (name, data) of the streamed response (framing and models checked)."""
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return response_events(r.read().decode())


def expected_words(cluster, messages, n):
    tok = cluster.services.card.tokenizer
    prompt = tok.encode(tok.render_chat(messages))
    return "".join(f" w{fake_token(prompt, 0, k)}" for k in range(n))


def test_route_answers_whole_and_streamed(cluster, http):
    body = {"model": MODEL, "input": "Hello", "instructions": "Be brief.", "max_output_tokens": 3}
    words = expected_words(
        cluster,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        3,
    )
    whole = post(http, body)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    [message] = whole.output
    assert message.type == "message" and message.content[0].text == words
    assert (
        whole.usage.output_tokens == 3 and whole.usage.total_tokens == whole.usage.input_tokens + 3
    )
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
    first = post(
        http, {"model": MODEL, "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 2}
    )
    answer = first.output[0].content[0].text
    events = stream(
        http,
        {"model": MODEL, "input": "More", "max_output_tokens": 2, "previous_response_id": first.id},
    )
    second = ResponsesResponse.model_validate(events[-1][1]["response"])
    assert second.previous_response_id == first.id and second.store
    tok = cluster.services.card.tokenizer
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "More"},
    ]  # instructions are not carried over
    sent = cluster.workers["d1"].requests[-1].prompt_token_ids
    assert list(sent) == tok.encode(tok.render_chat(conversation))
    third = post(
        http,
        {
            "model": MODEL,
            "input": "Again",
            "max_output_tokens": 1,
            "previous_response_id": second.id,
            "store": False,
        },
    )
    assert not third.store
    r = http.post("/v1/responses", json={"input": "x", "previous_response_id": third.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_route_refusals(http):
    for body, param in [
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "x", "model": "other"}, "model"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "service_tier": "auto"}, "service_tier"),
    ]:
        r = http.post("/v1/responses", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    r = http.post("/v1/responses", json={"input": "x", "max_output_tokens": 10**6})
    assert "max_completion_tokens" not in r.text


def test_openai_client(cluster):
    """The official client reads the bodies and events (its stream helper accumulates them)."""
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    words = expected_words(cluster, [{"role": "user", "content": "Hello"}], 3)
    response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    assert response.output_text == words[: words.rindex(" ")] and response.status == "incomplete"
    stop = {"stop": [" " + words.split(" ")[3]]}  # the third word: completed after two
    with client.responses.stream(
        model=MODEL, input="Hello", max_output_tokens=5, extra_body=stop
    ) as events:
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
        d["delta"] for n, d in events if n == "response.output_text.delta"
    )
    r = http.post("/v1/responses", json={"input": "x", "previous_response_id": failed.id})
    assert r.status_code == 404


# ---- through chat's parsers: tool calls, reasoning ----------------------------------------
@pytest.fixture
def say(cluster):
    """Makes the fake worker write `text` (in 3-character tokens, ending as the model's EOS)."""
    behavior = cluster.workers["d1"].behavior

    def say(text: str) -> None:
        behavior.script = [(100 + i, text[i : i + 3]) for i in range(0, len(text), 3)]
        behavior.script_finish, behavior.default_max_tokens = "stop", len(behavior.script)

    yield say
    behavior.script, behavior.script_finish, behavior.default_max_tokens = None, "length", 32


def calls_of(body: ResponsesResponse):
    return [(i.name, json.loads(i.arguments)) for i in body.output if i.type == "function_call"]


def test_a_named_function_call(cluster, http, say):
    say('{"city": "Paris"}')
    body = {
        "model": MODEL,
        "input": "Weather in Paris?",
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    whole = post(http, body)
    [call] = whole.output
    assert (call.type, call.name, call.arguments, call.status) == (
        "function_call",
        "get_weather",
        '{"city": "Paris"}',
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert whole.status == "completed" and whole.tool_choice.name == "get_weather"
    assert [t.name for t in whole.tools] == ["get_weather", "get_time"]
    so = cluster.workers["d1"].requests[-1].sampling.structured_outputs
    assert json.loads(so.json) == WEATHER["parameters"]  # chat's constraint for a named call
    events = stream(http, body)
    kinds = [n.removeprefix("response.") for n, _ in events]
    assert kinds == ["created", "in_progress", "output_item.added"] + [
        "function_call_arguments.delta"
    ] * 6 + ["function_call_arguments.done", "output_item.done", "completed"]
    done = next(d for n, d in events if n == "response.function_call_arguments.done")
    assert (
        "".join(d["delta"] for n, d in events if n.endswith("arguments.delta"))
        == done["arguments"]
        == '{"city": "Paris"}'
        and done["name"] == "get_weather"
    )


def test_required_calls_counted(cluster, http, say):
    def sample(name):
        return (
            cluster.router.services.metrics.registry.get_sample_value(
                name, {"tool_choice": "required"}
            )
            or 0
        )

    before = sample("pdserve_router_tool_requests_total"), sample("pdserve_router_tool_calls_total")
    say(
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {"tz": "CET"}}]'
    )
    body = {
        "model": MODEL,
        "input": "Weather and time?",
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
    }
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
    first = post(
        http,
        {
            "model": MODEL,
            "input": "Weather in Paris?",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
        },
    )
    [call] = first.output
    say("It is sunny.")
    second = post(
        http,
        {
            "model": MODEL,
            "previous_response_id": first.id,
            "tools": [WEATHER],
            "tool_choice": "none",
            "input": [
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
            ],
        },
    )
    assert second.output[0].content[0].text == "It is sunny."
    tok = cluster.services.card.tokenizer
    prompt = tok.decode(list(cluster.workers["d1"].requests[-1].prompt_token_ids))
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
        and "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    )
    # the same turn with the call sent back as input instead: the same prompt
    post(
        http,
        {
            "model": MODEL,
            "tools": [WEATHER],
            "tool_choice": "none",
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                call.model_dump(),
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
            ],
        },
    )
    assert tok.decode(list(cluster.workers["d1"].requests[-1].prompt_token_ids)) == prompt


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "'nope'",
        ),
        (
            {"tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "none"},
            "tools.0.name",
            "tools.0.name",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.name", "twice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "text.format",
            "text.format",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "input",
            "object",
        ),
    ],
)
def test_chat_refusals_name_the_responses_field(cluster, http, extra, param, words):
    before = len(cluster.workers["d1"].requests)
    r = http.post("/v1/responses", json={"model": MODEL, "input": "x", **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert len(cluster.workers["d1"].requests) == before  # no worker saw it


def test_auto_reasoning_text_and_calls_in_the_models_format(cluster, http, say):
    """qwen3 reasoning, then answer text, then two hermes calls: one item each, in order,
    whole and streamed the same."""
    say(
        "<think>Two cities.</think>Let me check. <tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    )
    body = {"model": MODEL, "input": "Weather and time?", "tools": [WEATHER, TIME]}  # auto
    whole = post(http, body)
    assert [i.type for i in whole.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert whole.output[0].content[0].text == "Two cities."
    assert whole.output[1].content[0].text == "Let me check. "
    assert calls_of(whole) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert whole.status == "completed" and whole.usage.output_tokens_details.reasoning_tokens > 0
    events = stream(http, body)
    final = ResponsesResponse.model_validate(events[-1][1]["response"])

    def strip(r):
        return [i.model_dump(exclude={"id", "call_id"}) for i in r.output]

    assert strip(final) == strip(whole) and final.usage == whole.usage

    def text(kind):
        return "".join(d["delta"] for n, d in events if n == f"response.{kind}.delta")

    assert text("reasoning_text") == "Two cities." and text("output_text") == "Let me check. "
    # the turn sent back: reasoning, text and calls are one assistant message
    assert output_messages([i.model_dump() for i in whole.output]) == [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me check. "}],
            "reasoning_content": "Two cities.",
            "tool_calls": [
                {
                    "id": c.call_id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in whole.output[2:]
            ],
        }
    ]
