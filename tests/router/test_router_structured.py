"""Structured outputs through the router's HTTP app (fake workers record what they got):
every way vLLM's users ask for a constraint (OpenAI response_format, vLLM structured_outputs,
the older guided_* fields) reaches the worker as one StructuredOutputs message; a constraint
that does not compile, or two constraints, is a 400 naming the field, and no worker sees it;
the compile runs off the event loop."""

import json
import threading

import httpx
import pytest
from router_harness import start_cluster

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
SCHEMA = {
    "type": "object",
    "properties": {"b": {"type": "string"}, "a": {"type": "integer"}},
    "required": ["a"],
}


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(bg, etcd.endpoint, "structured", [("decode", "d1")])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.router.url, timeout=60) as c:
        yield c


def _sent(cluster, http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    m = cluster.workers["d1"].requests[-1].sampling
    assert m.HasField("structured_outputs")
    return m.structured_outputs


@pytest.mark.parametrize(
    "path, extra, kind, value",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "json_object", True),
        (
            "/v1/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": SCHEMA, "strict": True},
                }
            },
            "json",
            json.dumps(SCHEMA),
        ),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
        ("/v1/completions", {"structured_outputs": {"json": SCHEMA}}, "json", json.dumps(SCHEMA)),
        (
            "/v1/completions",
            {"structured_outputs": {"grammar": 'root ::= "x"'}},
            "grammar",
            'root ::= "x"',
        ),
        ("/v1/chat/completions", {"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA)),
        ("/v1/completions", {"guided_regex": "a|b"}, "regex", "a|b"),
        ("/v1/chat/completions", {"guided_grammar": 'root ::= "y"'}, "grammar", 'root ::= "y"'),
        (
            "/v1/chat/completions",
            {"guided_choice": ["p", "q"], "guided_decoding_backend": "xgrammar"},
            "choice",
            ["p", "q"],
        ),
    ],
)
def test_each_form_reaches_the_worker(cluster, http, path, extra, kind, value):
    body = {**(CHAT if "chat" in path else COMP), **extra}
    so = _sent(cluster, http, path, body)
    assert so.WhichOneof("constraint") == kind
    got = getattr(so, kind)
    assert (list(got.values) if kind == "choice" else got) == value
    assert not so.disable_any_whitespace


def test_flags_join_a_constraint_given_another_way(cluster, http):
    so = _sent(
        cluster,
        http,
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            },
            "structured_outputs": {
                "disable_any_whitespace": True,
                "disable_additional_properties": True,
            },
        },
    )
    assert so.WhichOneof("constraint") == "json"
    assert so.disable_any_whitespace and so.disable_additional_properties
    so = _sent(
        cluster,
        http,
        "/v1/completions",
        {
            **COMP,
            "guided_regex": "a",
            "guided_decoding_backend": "auto:no-fallback,disable-any-whitespace",
        },
    )
    assert so.disable_fallback and so.disable_any_whitespace


def test_structural_tag(cluster, http):
    fmt = {
        "type": "triggered_tags",
        "triggers": ["<f"],
        "tags": [
            {
                "type": "tag",
                "begin": "<f>",
                "content": {"type": "json_schema", "json_schema": SCHEMA},
                "end": "</f>",
            }
        ],
    }
    so = _sent(
        cluster,
        http,
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "structural_tag", "format": fmt}},
    )
    assert json.loads(so.structural_tag) == {"type": "structural_tag", "format": fmt}
    # vLLM's older shape (structures + triggers) becomes the same format.
    so = _sent(
        cluster,
        http,
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {
                "type": "structural_tag",
                "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
                "triggers": ["<f"],
            },
        },
    )
    assert json.loads(so.structural_tag)["format"]["tags"][0]["content"]["json_schema"] == SCHEMA


def test_text_response_format_is_unconstrained(cluster, http):
    r = http.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert r.status_code == 200
    assert not cluster.workers["d1"].requests[-1].sampling.HasField("structured_outputs")


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "s",
                        "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}},
                    },
                }
            },
            "response_format",
            "frobnicate",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
            "response_format",
            "schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "missing"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "json"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"structured_outputs": {"disable_any_whitespace": True}},
            "structured_outputs",
            "needs one of",
        ),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs",
            "xgrammar",
        ),
        ({"guided_regex": "[z-a]"}, "guided_regex", "regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}},
            "guided_json",
            "json",
        ),
        ({"guided_choice": []}, "guided_choice", "choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "choice"),
        (
            {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
            "guided_json",
            "only one",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
            "guided_choice",
            "only one",
        ),
        (
            {"guided_decoding_backend": "outlines", "guided_regex": "a"},
            "guided_decoding_backend",
            "xgrammar",
        ),
        ({"guided_decoding_backend": "xgrammar:whatever"}, "guided_decoding_backend", "whatever"),
        (
            {"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]?"},
            "guided_whitespace_pattern",
            "xgrammar",
        ),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
            "response_format",
            "structural_tag",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "response_format"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_constraints_are_a_400_naming_the_field(cluster, http, path, extra, param, words):
    before = len(cluster.workers["d1"].requests)
    r = http.post(path, json={**(CHAT if "chat" in path else COMP), **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert words in err["message"] and param.split(".")[0] in err["message"], err
    assert len(cluster.workers["d1"].requests) == before  # no worker was tied up


def test_compile_runs_off_the_event_loop(cluster, http, monkeypatch):
    grammars = cluster.services.grammars
    threads = []
    compile_ = grammars._compile
    monkeypatch.setattr(
        grammars,
        "_compile",
        lambda p, spent: (threads.append(threading.current_thread()), compile_(p, spent))[1],
    )
    _sent(cluster, http, "/v1/completions", {**COMP, "guided_regex": "[0-9]{3}"})
    assert threads and threads[0].name.startswith("grammar")  # the compile threads
