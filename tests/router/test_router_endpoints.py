"""vLLM's side endpoints through the router: /tokenize, /detokenize, /version,
/v1/models/{id}; X-Request-Id; a 500 carries no exception detail."""

import importlib.metadata
import re

import httpx
import pytest
from router_harness import start_cluster

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(
        bg, etcd.endpoint, "endpoints", [("decode", "d1")], api_key="k-0123456789abcdef"
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(
        base_url=cluster.router.url,
        timeout=30,
        headers={"Authorization": "Bearer k-0123456789abcdef"},
    ) as c:
        yield c


@pytest.fixture(scope="module")
def tok(cluster):
    return cluster.services.card.tokenizer


def error(response, status, param=None):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    return err


def test_tokenize(http, tok):
    r = http.post(
        "/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}
    ).json()
    ids = tok.encode("Hello world", add_special_tokens=True)
    assert r == {
        "count": len(ids),
        "max_model_len": 8192,
        "tokens": ids,
        "token_strs": ["Hello", "Ġworld"],
    }
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    r = http.post("/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == tok.encode(tok.render_chat(messages)) and "token_strs" not in r
    r = http.post(
        "/tokenize",
        json={"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
    ).json()
    assert tok.decode(r["tokens"]).endswith("assistant\nHel")
    error(
        http.post(
            "/tokenize",
            json={
                "messages": messages,
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
        ),
        400,
        "continue_final_message",
    )
    error(http.post("/tokenize", json={"prompt": "x", "messages": messages}), 400, "prompt")
    error(http.post("/tokenize", json={"prompt": 5}), 400, "prompt")
    error(http.post("/tokenize", json={"prompt": "x", "model": "other"}), 404, "model")


def test_detokenize(http, tok):
    ids = tok.encode("Grüße 世界")
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Grüße 世界"}
    error(http.post("/detokenize", json={"tokens": [1, 10**7]}), 400, "tokens")
    error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_version_and_model(http):
    assert http.get("/version").json() == {"version": importlib.metadata.version("pdserve")}
    m = http.get(f"/v1/models/{MODEL}").json()
    assert m["id"] == MODEL and m["object"] == "model" and m["max_model_len"] == 8192
    assert http.get("/v1/models").json()["data"] == [m]
    err = error(http.get("/v1/models/gpt-7"), 404, "model")
    assert err["code"] == "model_not_found" and err["type"] == "not_found_error"
    error(httpx.get(http.base_url.join(f"/v1/models/{MODEL}")), 401)


def test_request_id_header(http):
    r = http.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"X-Request-Id": "abc-123"},
    )
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    r = http.get("/health")
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
            "request_id": "mine",
        },
    )
    assert r.json()["id"] == "chatcmpl-mine" and r.headers["x-request-id"] != "mine"
    assert http.get("/nothing").headers["x-request-id"]


def test_internal_error_body_has_no_detail(cluster, http):
    dispatcher = cluster.services.dispatcher
    original = dispatcher.generate

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    dispatcher.generate = broken
    try:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    finally:
        dispatcher.generate = original
    err = error(r, 500)
    assert "secret" not in r.text and "RuntimeError" not in r.text
    assert err["type"] == "server_error"
