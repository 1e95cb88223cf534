"""Every route with a JSON body parses it the same way (router.endpoints.base.parse_json):
strictly, a refusal the OpenAI-shaped 400 naming the field; a body not declared JSON is a 415
(router/http/limits.py: no CSRF from a web page). In
process (httpx over ASGI): no worker, no etcd — each request is refused or answered before
one would be needed."""

import asyncio

import httpx
import pytest

from router.config import RouterConfig
from router.http.app import create_app
from router.http.auth import Keys
from router.server import RouterServices, load_model_card

# One body per route, with a field of the wrong type (a string where the model wants
# something else: never coerced) and the param the 400 must name.
WRONG_TYPE = [
    ("/v1/completions", {"prompt": "hi", "n": "2"}, "n"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "2"},
        "max_tokens",
    ),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
    ("/v1/embeddings", {"input": "hi", "priority": "1"}, "priority"),
    ("/v1/load_lora_adapter", {"lora_name": 1, "lora_path": "/x"}, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_int_id": "7"}, "lora_int_id"),
    ("/collective_rpc", {"method": "m", "timeout": "1"}, "timeout"),
    ("/update_weights", {"path": 5}, "path"),
]


@pytest.fixture(scope="module")
def app():
    config = RouterConfig(etcd="127.0.0.1:1", enable_lora=True, enable_dev_endpoints=True)
    # The lifespan never runs; no key is set.
    return create_app(RouterServices(config, load_model_card(config), Keys()))


def _post(app, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post(path, content=content, headers=headers)

    return asyncio.run(main())


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


@pytest.mark.parametrize("path, body, param", WRONG_TYPE)
def test_a_wrong_type_is_a_400_naming_the_field_on_every_route(app, path, body, param):
    import json

    err = _error(_post(app, path, json.dumps(body).encode(), {"Content-Type": "application/json"}))
    assert err["param"] == param and err["code"] == "invalid_value"
    assert param in err["message"]


@pytest.mark.parametrize("path", sorted({path for path, _, _ in WRONG_TYPE}))
@pytest.mark.parametrize(
    "raw, message",
    [
        (b"", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (
            b'{"prompt": "h\\ud800i"}',
            "not valid JSON",
        ),  # a lone surrogate never reaches a tokenizer
        (b"[1, 2]", "must be a JSON object"),
    ],
)
def test_a_malformed_body_is_a_400_on_every_route(app, path, raw, message):
    err = _error(_post(app, path, raw, {"Content-Type": "application/json"}))
    assert err["code"] == "invalid_json" and err["param"] is None
    assert message in err["message"]


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/vnd.api+json",
    ],
)
def test_a_json_content_type_is_parsed(app, content_type):
    r = _post(app, "/tokenize", b'{"prompt": "hi"}', {"Content-Type": content_type})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == 1
    err = _error(
        _post(
            app,
            "/v1/completions",
            b'{"prompt": "hi", "temperature": Infinity}',
            {"Content-Type": content_type},
        )
    )
    assert err["param"] == "temperature"


# What a web page may POST cross-site without a CORS preflight (a "simple request"): form or
# text bodies, a body without a type (fetch of a Blob). None of them reaches a handler. From a
# browser of another origin (it sends Origin) they are refused even earlier, by the Origin
# check (router/http/host_check.py): test_a_cross_origin_post_is_refused_before_its_body.
NOT_JSON = [
    ({"Content-Type": "application/x-www-form-urlencoded"}, b'{"prompt": "hi"}'),
    ({"Content-Type": "text/plain"}, b'{"prompt": "hi"}'),
    ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x--"),
    ({}, b'{"prompt": "hi"}'),
]


@pytest.mark.parametrize("path", ["/sleep", "/v1/completions"])
def test_a_cross_origin_post_is_refused_before_its_body(app, path):
    r = _post(app, path, b"", {"Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"


@pytest.mark.parametrize("path", sorted({path for path, _, _ in WRONG_TYPE}) + ["/sleep"])
@pytest.mark.parametrize("headers, body", NOT_JSON)
def test_a_body_not_declared_json_is_a_415_on_every_route(app, path, headers, body):
    r = _post(app, path, body, headers)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_media_type"
    assert "application/json" in err["message"]


def test_a_bodiless_post_from_a_script_needs_no_content_type(app):
    """vLLM's `curl -X POST .../reset_prefix_cache`: no body, no Content-Type, no Origin (no
    browser). It reaches the handler (here: 503, no worker registered)."""
    r = _post(app, "/reset_prefix_cache", b"", {})
    assert r.status_code == 503, r.text
