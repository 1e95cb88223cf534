"""`chat_template_kwargs` cannot set a template variable the server sets itself (issue 51): the
renderer's own arguments (`messages`, `add_generation_prompt`, `continue_final_message`, which
were an HTTP 500 with a logged TypeError) and what the request's fields fill (`tools`,
`documents`). Each is a 400 with the OpenAI error body naming the key, on chat completions
and /tokenize (/v1/responses refuses the field); other keys still reach the template. In
process (httpx over ASGI): no worker, no etcd."""

import asyncio
import logging

import httpx
import pytest

from router.config import RouterConfig
from router.http.app import create_app
from router.http.auth import Keys
from router.server import RouterServices, load_model_card

RESERVED = [
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "documents",
    "self",
]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def app():
    config = RouterConfig(etcd="127.0.0.1:1")
    return create_app(RouterServices(config, load_model_card(config), Keys()))


def _post(app, path: str, body: dict) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


def _bodies(kwargs: dict) -> list[tuple[str, dict]]:
    return [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **kwargs}),
        ("/tokenize", {"messages": MESSAGES, **kwargs}),
    ]


@pytest.mark.parametrize("key", RESERVED)
def test_a_key_the_server_sets_is_a_400_naming_it(app, key, caplog):
    for path, body in _bodies({"chat_template_kwargs": {key: []}}):
        with caplog.at_level(logging.ERROR):
            response = _post(app, path, body)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == f"chat_template_kwargs.{key}", path
        assert repr(key) in error["message"] and "reserved" in error["message"]
        assert not [r for r in caplog.records if r.exc_info], path  # no traceback logged
        caplog.clear()


def test_other_keys_and_the_fields_still_reach_the_template(app):
    """(Through /tokenize: a chat request the router accepts would wait for a worker.)"""
    plain = _post(app, "/tokenize", {"messages": MESSAGES})
    kwargs = {"greeting": "x", "enable_thinking": False}
    other = _post(app, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": kwargs})
    assert plain.status_code == other.status_code == 200, other.text
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    with_tools = _post(app, "/tokenize", {"messages": MESSAGES, "tools": [tool]})
    assert with_tools.status_code == 200, with_tools.text  # the server's own `tools`
