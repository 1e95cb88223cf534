"""Caps on a request's inputs (router/config.py LimitsConfig; router/generation/prepare.py):
prompts per
batch, n x prompts, stop strings, bad words, logit_bias entries, a text's length (checked
before it is tokenized) and a constraint's size; each a 400 naming the field, refused before
any worker is needed. In process (httpx over ASGI), no worker, no etcd. Large bodies are
tokenized on the tokenizer threads, never on the event loop."""

import asyncio
import json
import threading

import httpx
import pytest

from router.config import LimitsConfig, RouterConfig
from router.http.app import create_app
from router.http.auth import Keys
from router.server import RouterServices, load_model_card

LIMITS = LimitsConfig(
    max_prompts_per_request=4,
    max_choices_per_request=8,
    max_stop_strings=2,
    max_bad_words=2,
    max_logit_bias=2,
    max_grammar_bytes=256,
)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def services():
    config = RouterConfig(etcd="127.0.0.1:1", queue_timeout_s=0, limits=LIMITS)
    return RouterServices(config, load_model_card(config), Keys())  # lifespan never runs


@pytest.fixture(scope="module")
def app(services):
    return create_app(services)


@pytest.fixture
def encoded(services, monkeypatch):
    """The threads each text was tokenized on."""
    tok = services.card.tokenizer
    threads = []
    real = tok.encode

    def recording(text, add_special_tokens=False):
        threads.append(threading.current_thread().name)
        return real(text, add_special_tokens)

    monkeypatch.setattr(tok, "encode", recording)
    return threads


def _post(app, path: str, body: dict) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


def _refused(response: httpx.Response, param: str, code: str) -> str:
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code), err
    return err["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": ["a"] * 5}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2]] * 5}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}, "n"),  # 9 completions
        ("/v1/chat/completions", {**CHAT, "n": 9}, "n"),
        ("/v1/completions", {"prompt": "a", "stop": ["x", "y", "z"]}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": ["x", "y", "z"]}, "stop"),
        ("/v1/completions", {"prompt": "a", "bad_words": ["x", "y", "z"]}, "bad_words"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
        ("/v1/embeddings", {"input": ["a"] * 5}, "input"),
    ],
)
def test_a_count_over_its_cap_is_a_400_naming_the_field(app, encoded, path, body, param):
    assert "this server" in _refused(_post(app, path, body), param, "too_many_items")
    assert encoded == []  # refused before any text was tokenized


@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/v1/completions",
            {
                "prompt": ["a"] * 4,
                "n": 2,
                "stop": ["x", "y"],
                "bad_words": ["x", "y"],
                "logit_bias": {"1": 1, "2": 1},
                "max_tokens": 1,
            },
        ),
        ("/v1/embeddings", {"input": ["a"] * 4}),
    ],
)
def test_counts_at_their_caps_pass_the_checks(app, path, body):
    r = _post(app, path, body)
    assert r.status_code == 503, r.text  # accepted: it waits for a worker (none registered)


@pytest.mark.parametrize(
    "path, field",
    [
        ("/v1/completions", "prompt"),
        ("/v1/chat/completions", "messages"),
        ("/tokenize", "prompt"),
        ("/tokenize", "messages"),
        ("/v1/embeddings", "input"),
    ],
)
def test_a_text_longer_than_the_context_can_hold_is_never_tokenized(
    app, services, encoded, path, field
):
    """Default cap: max_model_len x the longest vocabulary entry — no longer text fits."""
    card = services.card
    text = "a" * (card.max_model_len * card.longest_token_chars + 1)
    body = {field: [{"role": "user", "content": text}]} if field == "messages" else {field: text}
    message = _refused(_post(app, path, body), field, "context_length_exceeded")
    assert "characters" in message and encoded == []


def test_max_prompt_chars_caps_text_below_the_context(services, encoded):
    config = RouterConfig(etcd="127.0.0.1:1", limits=LimitsConfig(max_prompt_chars=10))
    app = create_app(RouterServices(config, services.card, Keys()))
    assert _post(app, "/tokenize", {"prompt": "a" * 10}).json()["count"] >= 1
    _refused(_post(app, "/tokenize", {"prompt": "a" * 11}), "prompt", "context_length_exceeded")
    assert len(encoded) == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("guided_regex", "a" * 257),
        ("guided_json", {"enum": ["a" * 250]}),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a" * 250]}}},
        ),
        ("structured_outputs", {"choice": ["a" * 200, "b" * 57]}),
    ],
)
def test_a_constraint_over_the_size_cap_is_a_400_before_it_compiles(
    app, services, monkeypatch, field, value
):
    monkeypatch.setattr(services.grammars, "_compile", lambda p: pytest.fail("compiled"))
    message = _refused(
        _post(app, "/v1/completions", {"prompt": "a", field: value}), field, "grammar_too_large"
    )
    assert "max-grammar-bytes" in message


def test_a_large_body_is_tokenized_on_the_tokenizer_threads(app, encoded):
    text = "word " * 8000  # 40 KB: over the inline threshold (server.INLINE_BODY_BYTES)
    for path, body in [
        ("/tokenize", {"prompt": text}),
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/embeddings", {"input": text}),
    ]:
        encoded.clear()
        _post(app, path, body)
        assert encoded and encoded[0].startswith("tokenize"), (path, encoded)
    encoded.clear()
    assert _post(app, "/tokenize", {"prompt": "hi"}).status_code == 200
    assert encoded == ["MainThread"]  # a small one stays on the loop: cheaper


def test_a_large_detokenize_runs_on_the_tokenizer_threads(app, services, monkeypatch):
    tok = services.card.tokenizer
    threads = []
    real = tok.decode
    monkeypatch.setattr(
        tok,
        "decode",
        lambda ids, skip_special_tokens=False: (
            threads.append(threading.current_thread().name),
            real(ids, skip_special_tokens),
        )[1],
    )
    r = _post(app, "/detokenize", {"tokens": [1000] * 10_000})
    assert r.status_code == 200 and threads[0].startswith("tokenize"), threads


def test_the_limits_have_flags():
    import argparse

    from engine.flags import add_flags, from_args

    parser = argparse.ArgumentParser()
    add_flags(parser, RouterConfig)
    args = parser.parse_args(
        [
            "--etcd",
            "x:1",
            "--max-request-body-bytes",
            "2MiB",
            "--grammar-compile-timeout",
            "3",
            "--max-prompts-per-request",
            "9",
        ]
    )
    limits = from_args(RouterConfig, args).limits
    assert (
        limits.max_request_body_bytes,
        limits.grammar_compile_timeout_s,
        limits.max_prompts_per_request,
    ) == (2 << 20, 3.0, 9)
    with pytest.raises(Exception, match="max_stop_strings"):
        LimitsConfig(max_stop_strings=-1)
    json.dumps(LIMITS.__dict__)  # plain values
