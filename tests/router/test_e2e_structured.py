"""Structured outputs through the real cluster (router -> prefill worker -> decode worker),
driven by the official `openai` client as a vLLM user drives it: every output follows its
constraint (JSON validated with `jsonschema`), greedy output equals the single engine's, and
the first token — sampled on the prefill worker — already obeys the grammar.

The test model has 2 layers (near-garbage text), so schemas bound their strings and arrays
and JSON leaves out optional whitespace: every grammar completes well within max_tokens."""

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from openai_cluster import MODEL

from cluster.grpc_auth import aio_channel
from cluster.grpc_security import ClusterAuth
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]
STR = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": STR(8),
            "address": {
                "type": "object",
                "properties": {"city": STR(8), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": STR(6), "minItems": 1, "maxItems": 3},
            "grid": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
            },
        },
        "required": ["tags", "grid"],
    },
    "enums_numbers": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 100},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["color", "size", "count", "ratio"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9},
            "note": STR(5),
            "ok": {"type": "boolean"},
        },
        "required": ["id"],
    },
    "refs": {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "integer", "minimum": -5, "maximum": 5},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
    },
}
NO_WS = {"structured_outputs": {"disable_any_whitespace": True}}


def _schema_format(schema):
    return {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }


def _reference(reference, ids, **sampling):
    from engine import SamplingParams

    [out] = reference.generate([ids], SamplingParams(**sampling), use_tqdm=False)
    return [o.text for o in out.outputs]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_greedy_valid_and_equal_to_single_engine(client, reference, name):
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=200,
        response_format=_schema_format(schema),
        extra_body=NO_WS,
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)
    ids = reference.tokenizer.encode_chat(MESSAGES)
    assert [text] == _reference(
        reference,
        ids,
        temperature=0.0,
        max_tokens=200,
        structured_outputs={"json": schema, "disable_any_whitespace": True},
    )


@pytest.mark.parametrize("name", ["nested", "refs"])
def test_json_schema_seeded_n3(client, reference, name):
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=1.0,
        seed=7,
        n=3,
        max_tokens=200,
        response_format=_schema_format(schema),
        extra_body=NO_WS,
    )
    texts = [c.message.content for c in r.choices]
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
    ids = reference.tokenizer.encode_chat(MESSAGES)
    assert texts == _reference(
        reference,
        ids,
        temperature=1.0,
        seed=7,
        n=3,
        max_tokens=200,
        structured_outputs={"json": schema, "disable_any_whitespace": True},
    )


def test_streamed_json_schema(client):
    schema = SCHEMAS["optional_fields"]
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=200,
        stream=True,
        response_format=_schema_format(schema),
        extra_body=NO_WS,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object(client, reference):
    """Any JSON object. (The 2-layer model would run on whitespace, as vLLM's would: a bias
    towards "{}" lets the grammar complete.)"""
    [braces] = reference.tokenizer.encode("{}")
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=32,
        response_format={"type": "json_object"},
        logit_bias={str(braces): 100},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
        {"guided_regex": "[0-9]{3}-[a-z]{2}", "guided_decoding_backend": "xgrammar"},
    ],
)
def test_regex(client, extra):
    for temperature, seed in ((0, None), (1.0, 3)):
        r = client.completions.create(
            model=MODEL,
            prompt="Order number:",
            max_tokens=20,
            temperature=temperature,
            seed=seed,
            n=3 if seed else 1,
            extra_body=extra,
        )
        for c in r.choices:
            assert re.fullmatch("[0-9]{3}-[a-z]{2}", c.text), c.text


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"choice": ["zebra", "quokka", "ant"]}},
        {"guided_choice": ["zebra", "quokka", "ant"]},
    ],
)
def test_choice(client, extra):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=1.0,
        seed=11,
        n=3,
        extra_body=extra,
    )
    assert {c.message.content for c in r.choices} <= {"zebra", "quokka", "ant"}


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_json": SCHEMAS["refs"], "structured_outputs": {"disable_any_whitespace": True}},
        {
            "structured_outputs": {
                "json": json.dumps(SCHEMAS["refs"]),
                "disable_any_whitespace": True,
            }
        },
        {"guided_grammar": 'root ::= "x=" [0-9] [0-9]? ";"'},
        {"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "!"'}},
    ],
)
def test_vllm_forms(client, extra):
    r = client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=100, temperature=0, extra_body=extra
    )
    text = r.choices[0].text
    if "guided_grammar" in extra:
        assert re.fullmatch("x=[0-9][0-9]?;", text), text
    elif "structured_outputs" in extra and "grammar" in extra["structured_outputs"]:
        assert text in ("yes!", "no!"), text
    else:
        jsonschema.validate(json.loads(text), SCHEMAS["refs"])


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {
                "response_format": _schema_format(
                    {"type": "object", "properties": {"a": {"type": "nope"}}}
                )
            },
            "response_format",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs"),
        ({"extra_body": {"guided_regex": "[z-a]"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
            "guided_choice",
        ),
        (
            {"extra_body": {"guided_decoding_backend": "outlines", "guided_regex": "a"}},
            "guided_decoding_backend",
        ),
    ],
)
def test_invalid_constraints_are_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **extra)
    error = refused.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


async def _workers(e2e) -> dict[str, str]:
    return {w.role: w.grpc_address for w in await e2e.workers()}


async def _generate(
    address: str, request: pb.GenerateRequest, auth: ClusterAuth
) -> list[pb.GenerateResponse]:
    async with aio_channel(address, auth) as ch:
        return [r async for r in pb_grpc.DecodeWorkerStub(ch).Generate(request, timeout=120)]


def test_first_token_sampled_on_the_prefill_worker_obeys_the_grammar(e2e, reference):
    """A remote prefill's first token comes from the prefill worker: it must sample under the
    constraint. The unconstrained greedy first token is not allowed here, so a prefill worker
    that dropped the constraint would send it (and the output would not be a choice)."""
    from engine import SamplingParams

    choices = ["zebra", "quokka"]
    tok = reference.tokenizer
    ids = tok.encode_chat(MESSAGES)
    [free] = reference.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert not any(c.startswith(free.outputs[0].text) for c in choices)  # the test means something
    addresses = asyncio.run(_workers(e2e))
    request = pb.GenerateRequest(
        request_id="structured-first-token",
        prompt_token_ids=ids,
        sampling=pb.SamplingParams(
            temperature=0,
            max_tokens=10,
            structured_outputs=pb.StructuredOutputs(choice=pb.Choices(values=choices)),
        ),
        prefill_worker=pb.WorkerRef(worker_id="p", address=addresses["prefill"]),
    )
    responses = asyncio.run(_generate(addresses["decode"], request, e2e.auth))
    assert {r.prefill_mode for r in responses} == {"remote"}
    first = next(t for r in responses for t in r.token_ids)
    assert any(c.startswith(tok.decode([first])) for c in choices), tok.decode([first])
    assert "".join(r.text for r in responses) in choices
    assert responses[-1].finish_reason == "stop"
