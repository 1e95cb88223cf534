"""Every bad input gets its 4xx and an OpenAI-shaped error body naming the field; never a 500."""

import httpx
import openai
import pytest
from router_harness import start_cluster

KEY = "sk-errors-0123456789abcdef"
MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(bg, etcd.endpoint, "errors", [("decode", "d1")], api_key=KEY)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(
        base_url=cluster.router.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    ) as c:
        yield c


def _error(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def _with(base, **changes):
    body = {**base, **changes}
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize(
    "path, body, param",
    [
        # wrong types
        ("chat", _with(CHAT, temperature="hot"), "temperature"),
        ("chat", _with(CHAT, n="2"), "n"),
        ("chat", _with(CHAT, stream=1), "stream"),
        ("chat", _with(CHAT, max_tokens=2.5), "max_tokens"),
        ("chat", _with(CHAT, messages="hi"), "messages"),
        ("chat", _with(CHAT, messages=[{"role": "robot", "content": "hi"}]), "messages.0.role"),
        ("chat", _with(CHAT, messages=[{"role": "user", "content": 5}]), "messages.0.content"),
        ("chat", _with(CHAT, stop=[1, 2]), "stop"),
        ("comp", _with(COMP, prompt=["a", 1]), "prompt"),
        ("comp", _with(COMP, logprobs=True), "logprobs"),
        (
            "comp",
            _with(COMP, stream_options={"include_usage": "yes"}, stream=True),
            "stream_options.include_usage",
        ),
        # missing
        ("chat", _with(CHAT, messages=_DROP), "messages"),
        ("chat", _with(CHAT, messages=[]), "messages"),
        ("comp", _with(COMP, prompt=_DROP), "prompt"),
        # out of range
        ("chat", _with(CHAT, temperature=-1), "temperature"),
        ("chat", _with(CHAT, top_p=0), "top_p"),
        ("chat", _with(CHAT, top_p=1.5), "top_p"),
        ("chat", _with(CHAT, n=0), "n"),
        ("chat", _with(CHAT, n=1000), "n"),
        ("chat", _with(CHAT, max_tokens=0), "max_tokens"),
        ("chat", _with(CHAT, max_tokens=_DROP, max_completion_tokens=-3), "max_completion_tokens"),
        ("chat", _with(CHAT, presence_penalty=2.5), "presence_penalty"),
        ("chat", _with(CHAT, frequency_penalty=-3), "frequency_penalty"),
        ("chat", _with(CHAT, seed=-1), "seed"),
        ("chat", _with(CHAT, top_k=-2), "top_k"),
        ("chat", _with(CHAT, min_p=1.5), "min_p"),
        ("chat", _with(CHAT, repetition_penalty=0), "repetition_penalty"),
        ("chat", _with(CHAT, logprobs=True, top_logprobs=21), "top_logprobs"),
        ("chat", _with(CHAT, top_logprobs=2), "top_logprobs"),
        ("chat", _with(CHAT, stop=["ok", ""]), "stop"),
        ("chat", _with(CHAT, cache_salt=""), "cache_salt"),
        ("chat", _with(CHAT, stream_options={"include_usage": True}), "stream_options"),
        ("comp", _with(COMP, logprobs=21), "logprobs"),
        ("comp", _with(COMP, prompt=""), "prompt"),
        ("comp", _with(COMP, prompt=[]), "prompt"),
        ("comp", _with(COMP, prompt=[1, 10**7]), "prompt"),
        ("comp", _with(COMP, stop_token_ids=[-1]), "stop_token_ids"),
        # not supported here
        (
            "chat",
            _with(CHAT, tools=[{"type": "function", "function": {"name": "f"}}]),
            "tool_choice",
        ),
        (
            "chat",
            _with(
                CHAT,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                },
            ),
            "response_format",
        ),
        ("chat", _with(CHAT, logit_bias={"99999999": 1.0}), "logit_bias"),
        ("chat", _with(CHAT, logit_bias={"5": 101}), "logit_bias"),
        (
            "chat",
            _with(
                CHAT,
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            ),
            "messages.0.content.0.type",
        ),
        ("chat", _with(CHAT, echo=True), "echo"),
        ("comp", _with(COMP, best_of=3), "best_of"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    err = _error(http.post(url, json=body), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert param.split(".")[0] in err["message"]


def test_context_length(http):
    long_text = "hello " * 9000  # > 8192 tokens
    err = _error(
        http.post(
            "/v1/chat/completions",
            json=_with(CHAT, messages=[{"role": "user", "content": long_text}]),
        ),
        400,
    )
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    assert "8192" in err["message"]
    err = _error(http.post("/v1/completions", json=_with(COMP, prompt=list(range(8192)))), 400)
    assert err["param"] == "prompt"
    err = _error(
        http.post("/v1/completions", json=_with(COMP, prompt=list(range(8000)), max_tokens=500)),
        400,
    )
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"null", b'"text"'])
def test_malformed_body(http, raw):
    err = _error(
        http.post(
            "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
        ),
        400,
    )
    assert err["code"] in ("invalid_json", "invalid_value")


def test_unknown_model_route_and_method(http):
    err = _error(http.post("/v1/completions", json=_with(COMP, model="gpt-7")), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    _error(http.get("/v1/nothing"), 404)
    _error(http.get("/v1/completions"), 405)


def test_api_key(cluster, http):
    url = cluster.router.url
    err = _error(
        httpx.post(url + "/v1/completions", json=COMP, headers={"Authorization": "Bearer wrong"}),
        401,
    )
    assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
    _error(httpx.get(url + "/v1/models"), 401)
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    assert httpx.get(url + "/metrics").status_code == 200
    bad = openai.OpenAI(base_url=cluster.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=cluster.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        good.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert info.value.body["param"] == "temperature"
    text = httpx.get(url + "/metrics").text
    assert 'pdserve_router_requests_total{endpoint="/v1/completions",status="401"}' in text
    assert 'status="500"' not in text
