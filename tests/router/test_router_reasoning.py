"""Reasoning output through the router's HTTP app (--reasoning-parser qwen3), with fake
workers streaming scripted model text: reasoning and answer split, whole and streamed alike;
a constraint reaches the worker gated by the markers' token ids, so it binds the answer only;
tool calls are read from the answer only."""

import json
from pathlib import Path

import httpx
import pytest
from router_harness import start_cluster

from cluster.chat_config import ChatConfig
from router.endpoints.chat.protocol import ChatCompletionResponse, ChatCompletionStreamChunk

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = str(Path(__file__).resolve().parents[2] / "examples" / "tool_chat_template_chatml.jinja")
ASK = [{"role": "user", "content": "6 x 7?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(
        bg,
        etcd.endpoint,
        "reasoning",
        [("decode", "d1")],
        chat=ChatConfig(
            chat_template=TEMPLATE,
            reasoning_parser="qwen3",
            enable_auto_tool_choice=True,
            tool_call_parser="hermes",
        ),
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.router.url, timeout=60) as c:
        yield c


def _say(cluster, text: str) -> None:
    b = cluster.workers["d1"].behavior
    b.script = [(100 + i, text[i : i + 2]) for i in range(0, len(text), 2)]
    b.script_finish, b.default_max_tokens = "stop", len(b.script)


def _both(http, **body) -> tuple[dict, dict]:
    """The non-streamed message, and the streamed deltas joined."""
    full = {"model": MODEL, "messages": ASK, **body}
    r = http.post("/v1/chat/completions", json=full)
    assert r.status_code == 200, r.text
    message = (
        ChatCompletionResponse.model_validate(r.json())
        .choices[0]
        .message.model_dump(exclude_none=True)
    )
    joined: dict = {}
    with http.stream("POST", "/v1/chat/completions", json={**full, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = ChatCompletionStreamChunk.model_validate_json(line[6:])
                for choice in chunk.choices:
                    for key in ("content", "reasoning_content", "reasoning"):
                        joined[key] = joined.get(key, "") + (getattr(choice.delta, key) or "")
    return message, joined


def test_reasoning_and_answer_are_split_alike_whole_and_streamed(cluster, http):
    _say(cluster, "<think>\nsix sevens</think>\n\nIt is 42.")
    message, joined = _both(http)
    assert message["reasoning_content"] == message["reasoning"] == "\nsix sevens"
    assert message["content"] == "\n\nIt is 42."
    assert joined == {
        "content": "\n\nIt is 42.",
        "reasoning_content": "\nsix sevens",
        "reasoning": "\nsix sevens",
    }
    message, joined = _both(http, include_reasoning=False)
    assert "reasoning_content" not in message and joined["reasoning_content"] == ""
    assert message["content"] == "\n\nIt is 42."


def test_a_constraint_is_gated_by_the_markers_token_ids(cluster, http):
    _say(cluster, '<think>json it</think>{"a": 1}')
    message, _ = _both(http, response_format={"type": "json_object"})
    assert message["content"] == '{"a": 1}' and message["reasoning_content"] == "json it"
    so = cluster.workers["d1"].requests[-1].sampling.structured_outputs
    tok = cluster.router.services.card.tokenizer
    assert list(so.reasoning_start) == tok.encode("<think>", add_special_tokens=False)
    assert list(so.reasoning_end) == tok.encode("</think>", add_special_tokens=False)


def test_tool_calls_are_read_from_the_answer_only(cluster, http):
    _say(
        cluster,
        '<think><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
        '</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
        "\n</tool_call>",
    )
    message, _ = _both(http, tools=[WEATHER])
    assert message["reasoning_content"].startswith("<tool_call>")  # thinking about a call
    [call] = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    so = cluster.workers["d1"].requests[-1].sampling.structured_outputs
    assert so.WhichOneof("constraint") == "structural_tag" and list(so.reasoning_end)


def test_thinking_turned_off_in_the_template_makes_everything_answer(cluster, http):
    # A template that writes an empty think block when thinking is off (as Qwen3's does).
    _say(cluster, "Plain answer </think> with a stray marker.")
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [*ASK, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "Plain answer </think> with a stray marker."
    assert message["reasoning_content"] is None
