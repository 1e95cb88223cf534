"""Tool calling on the real cluster (prefill + decode workers, SmolLM2 cut to 2 layers: its
text is noise, which is the point — only the constraints make its calls valid), driven by the
official `openai` client and by the OpenAI Agents SDK, through a router started with the
ChatML tool template, --enable-auto-tool-choice and --tool-call-parser hermes."""

import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from openai_cluster import KEY, MODEL, REPO, start_router
from pydantic import Field

TEMPLATE = str(REPO / "examples" / "tool_chat_template_chatml.jinja")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hours"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_url(e2e):
    with start_router(
        e2e.etcd,
        e2e.logs,
        "--chat-template",
        TEMPLATE,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        security=e2e.router_security,
        name="tools-router",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def tc(tools_url):
    return openai.OpenAI(base_url=tools_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _valid(calls, names) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _streamed(stream) -> dict[int, dict]:
    """choice index -> {"calls": {index: {id, name, arguments}}, "finish": reason}."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            state = choices.setdefault(c.index, {"calls": {}, "finish": None, "content": ""})
            state["content"] += c.delta.content or ""
            for piece in c.delta.tool_calls or []:
                call = state["calls"].setdefault(piece.index, {"arguments": ""})
                if piece.id:
                    call["id"], call["name"] = piece.id, piece.function.name
                call["arguments"] += piece.function.arguments or ""
            state["finish"] = c.finish_reason or state["finish"]
    return choices


SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_required_calls_always_parse_and_follow_their_schemas(tc, sampling):
    # One call each (parallel_tool_calls false): a noise model would go on adding calls.
    r = tc.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        n=2,
        max_tokens=120,
        parallel_tool_calls=False,
        **sampling,
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert _valid(choice.message.tool_calls, SCHEMAS)
    stream = tc.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        n=2,
        max_tokens=120,
        parallel_tool_calls=False,
        stream=True,
        **sampling,
    )
    for i, state in _streamed(stream).items():
        assert state["finish"] == "tool_calls"
        calls = [state["calls"][k] for k in sorted(state["calls"])]
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        if sampling["temperature"] == 0:  # greedy: streamed == whole
            assert [(c["name"], json.loads(c["arguments"])) for c in calls] == _valid(
                r.choices[i].message.tool_calls, SCHEMAS
            )


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_a_named_function_always_parses(tc, sampling):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = tc.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        n=2,
        max_tokens=60,
        **sampling,
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        [(name, _)] = _valid(choice.message.tool_calls, {"get_time"})
    stream = tc.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=60,
        stream=True,
        **sampling,
    )
    [state] = _streamed(stream).values()
    [call] = state["calls"].values()
    assert call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_time"])


def test_a_two_turn_tool_loop(tc, tools_url):
    first = tc.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=80,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = first.choices[0].message.tool_calls
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = tc.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # The call and its result were rendered into the second prompt (the template's format).
    rendered = httpx.post(
        tools_url + "/tokenize",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "messages": history, "tools": [WEATHER], "return_token_strs": True},
    ).json()
    assert second.usage.prompt_tokens == rendered["count"]
    assert "response" in "".join(rendered["token_strs"])  # <tool_response> was rendered


def test_an_uncompilable_tool_schema_is_a_400(tc):
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "pattern": "(("}},
            },
        },
    }
    with pytest.raises(openai.BadRequestError) as exc:
        tc.chat.completions.create(
            model=MODEL, messages=ASK, tools=[bad], tool_choice="required", max_tokens=4
        )
    assert exc.value.body["param"] == "tools"


def _weather_agent(tools_url: str, model_class: str, **agent_options):
    """An OpenAI Agents SDK agent on the tools router whose one tool records its calls:
    (agent, the cities the tool was called with)."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """Current weather in a city."""
        ran.append(city)
        return "sunny, 21 C"

    client = AsyncOpenAI(base_url=tools_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=getattr(agents, model_class)(model=MODEL, openai_client=client),
        # One call on the first turn (a noise model would go on adding calls).
        model_settings=agents.ModelSettings(
            tool_choice="required", temperature=0, parallel_tool_calls=False, max_tokens=80
        ),
        **agent_options,
    )
    return agent, ran


def test_the_openai_agents_sdk_runs_a_tool_loop_through_chat_completions(tools_url):
    """An agent framework's own client: the SDK calls the model with its tool (required on
    the first turn), runs the tool, sends the result back, and gets an answer."""
    import agents

    agent, ran = _weather_agent(tools_url, "OpenAIChatCompletionsModel")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(ran) >= 1 and all(isinstance(city, str) for city in ran)
    assert isinstance(result.final_output, str)


RESPONSES_TOOL = {"type": "function", **WEATHER["function"]}


def test_responses_with_a_function_tool_whole_and_streamed(tc):
    r = tc.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        instructions="Use the tool.",
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    )
    assert r.status == "completed"
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    events = list(
        tc.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            instructions="Use the tool.",
            tools=[RESPONSES_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=80,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(pieces) == json.loads(call.arguments)  # greedy: streamed == whole
    # A follow-up turn: the call's output goes back as input; the answer is text.
    answer = tc.responses.create(
        model=MODEL,
        tools=[RESPONSES_TOOL],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
    )
    assert answer.output_text and answer.usage.output_tokens > 0


def test_the_openai_agents_sdk_runs_a_tool_loop_through_responses(tools_url):
    import agents

    # The tool's result is the answer: a 2-layer model's free text would run into
    # max_tokens, which the SDK treats as a failed (incomplete) response.
    agent, ran = _weather_agent(
        tools_url, "OpenAIResponsesModel", tool_use_behavior="stop_on_first_tool"
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(ran) == 1 and result.final_output == "sunny, 21 C"
