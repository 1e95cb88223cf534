"""Tool calling through the router's HTTP app, with fake workers that stream scripted model
text: the constraint each tool_choice sends to the worker, the calls read back (whole and
streamed, the same), follow-up turns rendered through the template, and every refusal a 400
naming the field, with no worker call."""

import json
from pathlib import Path

import httpx
import pytest
from router_harness import start_cluster

from cluster.chat_config import ChatConfig
from router.endpoints.chat.protocol import ChatCompletionResponse, ChatCompletionStreamChunk

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = str(Path(__file__).resolve().parents[2] / "examples" / "tool_chat_template_chatml.jinja")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _script(text: str, piece: int = 3) -> list[tuple[int, str]]:
    return [(100 + i, text[i : i + piece]) for i in range(0, len(text), piece)]


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(
        bg,
        etcd.endpoint,
        "tools",
        [("decode", "d1")],
        chat=ChatConfig(
            chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes"
        ),
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.router.url, timeout=60) as c:
        yield c


def _say(cluster, text: str, finish: str = "stop") -> None:
    b = cluster.workers["d1"].behavior
    b.script, b.script_finish = _script(text), finish
    b.default_max_tokens = len(b.script)


def _chat(http, **body):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert r.status_code == 200, r.text
    return ChatCompletionResponse.model_validate(r.json()).model_dump(exclude_unset=True)


def _stream(http, **body) -> tuple[list[dict], dict]:
    """Every chunk, and the message a client's accumulator builds from them."""
    chunks = []
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "stream": True, **body},
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(
                    ChatCompletionStreamChunk.model_validate_json(line[6:]).model_dump(
                        exclude_none=True
                    )
                )
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            d = choice["delta"]
            content += d.get("content", "")
            for piece in d.get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"arguments": ""})
                if "id" in piece:
                    assert "name" not in call, "a call announced twice"
                    call["id"], call["name"] = piece["id"], piece["function"]["name"]
                call["arguments"] += piece["function"].get("arguments", "")
            finish = choice.get("finish_reason") or finish
    return chunks, {
        "content": content,
        "calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
    }


def _worker_constraint(cluster) -> dict:
    so = cluster.workers["d1"].requests[-1].sampling.structured_outputs
    kind = so.WhichOneof("constraint")
    return {"kind": kind, "value": json.loads(getattr(so, kind))}


def test_a_named_function_is_constrained_to_its_schema_and_read_as_one_call(cluster, http):
    _say(cluster, '{"city": "Paris"}')
    body = _chat(
        http,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert _worker_constraint(cluster) == {
        "kind": "json",
        "value": WEATHER["function"]["parameters"],
    }
    [choice] = body["choices"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "stop"  # OpenAI: a named function finishes with stop
    _, streamed = _stream(
        http,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert streamed["finish_reason"] == "stop" and streamed["content"] == ""


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_calls_finishing_with_tool_calls(cluster, http, parallel):
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {"tz": "CET"}}]'
    )
    _say(cluster, text)
    body = _chat(http, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel)
    sent = _worker_constraint(cluster)
    assert sent["kind"] == "json" and sent["value"]["type"] == "array"
    assert sent["value"]["minItems"] == 1 and sent["value"].get("maxItems") == (
        None if parallel else 1
    )
    names = [v["properties"]["name"]["enum"] for v in sent["value"]["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    [choice] = body["choices"]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"]["tool_calls"]
    ]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert choice["finish_reason"] == "tool_calls"
    _, streamed = _stream(http, tools=[WEATHER, TIME], tool_choice="required")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == calls
    assert len({c["id"] for c in streamed["calls"]}) == 2
    assert streamed["finish_reason"] == "tool_calls"


def test_none_leaves_the_text_alone_and_sends_no_constraint(cluster, http):
    _say(cluster, '<tool_call>{"name": "get_weather"}</tool_call>')
    body = _chat(http, tools=[WEATHER], tool_choice="none")
    assert not cluster.workers["d1"].requests[-1].sampling.HasField("structured_outputs")
    message = body["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": '<tool_call>{"name": "get_weather"}</tool_call>',
    }


def test_a_two_turn_conversation_renders_calls_and_results_through_the_template(cluster, http):
    _say(cluster, "It is sunny.")
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    body = _chat(http, messages=history, tools=[WEATHER], tool_choice="none")
    assert body["choices"][0]["message"]["content"] == "It is sunny."
    tok = cluster.router.services.card.tokenizer
    prompt = tok.decode(list(cluster.workers["d1"].requests[-1].prompt_token_ids))
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '"name": "get_weather", "description": "Current weather in a city"' in prompt


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": []}, "tools", "empty"),
        (
            {"tools": [WEATHER, WEATHER], "tool_choice": "required"},
            "tools.1.function.name",
            "twice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
                "tool_choice": "none",
            },
            "tools.0.function.name",
            "",
        ),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type", ""),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "cannot be combined",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "string", "pattern": "(("}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": f"c{i}",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{}"},
                            }
                            for i in (1, 2)
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "x"},
                ],
            },
            "messages.1.tool_calls",
            "parallel_tool_calls is false",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1]"},
                            }
                        ],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
            "object",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(cluster, http, extra, param, words):
    before = len(cluster.workers["d1"].requests)
    r = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert len(cluster.workers["d1"].requests) == before  # no worker saw it


def test_a_template_without_tools_is_refused_naming_the_missing_piece(etcd, bg):
    c = start_cluster(
        bg, etcd.endpoint, "tools-plain", [("decode", "d1")]
    )  # SmolLM2's own template
    try:
        with httpx.Client(base_url=c.router.url, timeout=60) as http:
            for extra, param, piece in [
                ({"tools": [WEATHER], "tool_choice": "required"}, "tools", "render tools"),
                ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),  # the default
                ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
                (
                    {
                        "messages": [
                            *ASK,
                            {
                                "role": "assistant",
                                "tool_calls": [
                                    {
                                        "id": "c",
                                        "type": "function",
                                        "function": {"name": "get_weather", "arguments": "{}"},
                                    }
                                ],
                            },
                        ]
                    },
                    "messages.1.tool_calls",
                    "render tool calls",
                ),
            ]:
                r = http.post(
                    "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **extra}
                )
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == param and piece in error["message"]
                assert param == "tool_choice" or "--chat-template" in error["message"]
    finally:
        c.stop()


def test_tool_requests_and_calls_are_counted(cluster, http):
    def sample(name, **labels):
        return cluster.router.services.metrics.registry.get_sample_value(name, labels) or 0

    before = (
        sample("pdserve_router_tool_requests_total", tool_choice="required"),
        sample("pdserve_router_tool_calls_total", tool_choice="required"),
    )
    _say(cluster, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    _chat(http, tools=[WEATHER], tool_choice="required")
    _stream(http, tools=[WEATHER], tool_choice="required")
    after = (
        sample("pdserve_router_tool_requests_total", tool_choice="required"),
        sample("pdserve_router_tool_calls_total", tool_choice="required"),
    )
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)
    data = http.get("/dashboard/data").json()
    assert data["tool_requests"] >= 2 and data["tool_calls"] >= 2


HERMES_TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}'
    "\n</tool_call>"
)


def test_auto_reads_the_model_format_and_is_constrained_after_the_marker(cluster, http):
    _say(cluster, HERMES_TEXT)
    body = _chat(http, tools=[WEATHER, TIME])  # tool_choice auto by default
    sent = _worker_constraint(cluster)
    assert sent["kind"] == "structural_tag"
    assert sent["value"]["format"]["triggers"] == ["<tool_call>"]
    [choice] = body["choices"]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"]["tool_calls"]
    ]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert choice["message"]["content"] == "Let me check. "
    assert choice["finish_reason"] == "tool_calls"
    _, streamed = _stream(http, tools=[WEATHER, TIME], tool_choice="auto")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == calls
    assert streamed["content"] == "Let me check. " and streamed["finish_reason"] == "tool_calls"


def test_auto_without_a_call_is_content_that_finishes_with_stop(cluster, http):
    _say(cluster, "No tool needed: <tool is a word> here.")
    body = _chat(http, tools=[WEATHER], tool_choice="auto")
    [choice] = body["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": "No tool needed: <tool is a word> here.",
    }
    assert choice["finish_reason"] == "stop"
    chunks, streamed = _stream(http, tools=[WEATHER], tool_choice="auto")
    assert streamed == {
        "content": "No tool needed: <tool is a word> here.",
        "calls": [],
        "finish_reason": "stop",
    }


def test_a_call_cut_by_max_tokens_finishes_with_length(cluster, http):
    cut = HERMES_TEXT.index("Paris") + 2  # inside the arguments
    _say(cluster, HERMES_TEXT[:cut], finish="length")
    body = _chat(http, tools=[WEATHER, TIME])
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length"
    [call] = choice["message"]["tool_calls"]  # as far as the model wrote it
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    _say(cluster, HERMES_TEXT[: HERMES_TEXT.index("arguments")], finish="length")
    [choice] = _chat(http, tools=[WEATHER, TIME])["choices"]  # cut before the arguments: text
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == HERMES_TEXT[: HERMES_TEXT.index("arguments")]
