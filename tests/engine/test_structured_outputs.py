"""Structured outputs in the engine: every output follows its JSON schema / regex / choice /
grammar (greedy, seeded, n = 3, with speculation, under preemption); an unconstrained
neighbour is unaffected; invalid constraints are errors naming the field; a grammar that
cannot finish within max_tokens ends with "length"."""

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.checks import FieldError

NUM_LAYERS = 4
PROMPT = "Describe a person as JSON:"
SHORT = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": SHORT,
            "address": {
                "type": "object",
                "properties": {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": SHORT, "minItems": 2, "maxItems": 3}},
        "required": ["tags"],
    },
    "enum_and_numbers": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog", "bird"]},
            "age": {"type": "integer", "minimum": 1, "maximum": 30},
            "weight": {"type": "number", "minimum": 0.5, "maximum": 80},
        },
        "required": ["kind", "age", "weight"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": SHORT,
            "subtitle": SHORT,
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["title"],
    },
    "ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
}


def _llm(model_dir, **engine_args):
    engine_args.setdefault("kv_cache_memory", 64 << 20)
    return LLM(str(model_dir), num_layers=NUM_LAYERS, dtype="float32", **engine_args)


@pytest.fixture(scope="module")
def llm(model_dir):
    return _llm(model_dir)


def _json(schema, **params):
    return SamplingParams(
        max_tokens=160,
        **params,
        structured_outputs={"json": schema, "disable_any_whitespace": True},
    )


def test_every_output_validates_against_its_schema(llm):
    """Each schema greedy and sampled with n = 3, all in one batch."""
    names = sorted(SCHEMAS)
    params = [_json(SCHEMAS[n], temperature=0.0) for n in names]
    params += [_json(SCHEMAS[n], temperature=1.0, seed=11, n=3) for n in names]
    results = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for name, result in zip(names + names, results):
        for out in result.outputs:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[A-Z][a-z]{2,6}-[0-9]{2,3}"
    grammar = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [a-c] | "xyz"'
    cases = [
        ({"regex": regex}, lambda t: re.fullmatch(regex, t)),
        ({"choice": ["red", "green", "light blue"]}, lambda t: t in ("red", "green", "light blue")),
        (
            {"grammar": grammar},
            lambda t: re.fullmatch(r"\((?:[a-c]|xyz)(?:,(?:[a-c]|xyz)){0,2}\)", t),
        ),
        # without whitespace, as the schemas here: with it this 4-layer model pads the object
        # with spaces until max_tokens, so its outputs never closed and were never checked
        (
            {"json_object": True, "disable_any_whitespace": True},
            lambda t: isinstance(json.loads(t), dict),
        ),
    ]
    for constraint, check in cases:
        for params in (
            SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=constraint),
            SamplingParams(
                temperature=0.9, seed=3, n=3, max_tokens=200, structured_outputs=constraint
            ),
        ):
            for out in llm.generate(PROMPT, params, use_tqdm=False)[0].outputs:
                assert out.finish_reason == "stop" and check(out.text), (constraint, out.text)


def test_an_unconstrained_neighbour_is_unaffected(llm):
    plain = SamplingParams(temperature=0.8, seed=5, max_tokens=24, logprobs=1)
    alone = llm.generate(PROMPT, plain, use_tqdm=False)[0].outputs[0]
    batch = llm.generate(
        [PROMPT, PROMPT], [_json(SCHEMAS["nested"], temperature=0.0), plain], use_tqdm=False
    )
    beside = batch[1].outputs[0]
    assert (beside.token_ids, beside.text) == (alone.token_ids, alone.text)
    assert [lp.logprob for lp in beside.logprobs] == pytest.approx(
        [lp.logprob for lp in alone.logprobs], abs=1e-4
    )  # batch composition: last float bits


def test_same_output_with_speculation_and_under_preemption(llm, model_dir):
    params = [_json(SCHEMAS[name], temperature=0.0) for name in sorted(SCHEMAS)]
    params += [
        _json(SCHEMAS[name], temperature=0.9, seed=i) for i, name in enumerate(sorted(SCHEMAS))
    ]
    prompts = [PROMPT] * len(params)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    # these two compile in their own thread (timeout 0), not in a child process of their own
    # (xgrammar's import and the vocabulary index there: ~3 s each); `llm` compiled in one
    in_thread = {"grammar_compile_timeout_s": 0}
    spec = _llm(
        model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **in_thread
    )
    assert [o.outputs[0].text for o in spec.generate(prompts, params, use_tqdm=False)] == expected
    assert spec.engine.stats().spec_num_accepted_tokens > 0
    small = _llm(model_dir, kv_cache_memory=10 * 4 * 2 * 16 * 3 * 64 * 4, **in_thread)  # 10 blocks
    assert [o.outputs[0].text for o in small.generate(prompts, params, use_tqdm=False)] == expected
    assert small.engine.stats().num_preemptions > 0


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=5,
        structured_outputs={"json": SCHEMAS["nested"], "disable_any_whitespace": True},
    )
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


@pytest.mark.parametrize(
    "constraint, field",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "json"),
        ({"json": "{not json"}, "json"),
        ({"regex": "([a-z"}, "regex"),
        ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ],
)
def test_invalid_constraints_are_errors_naming_the_field(llm, constraint, field):
    with pytest.raises(FieldError) as err:
        llm.engine.make_request("bad", PROMPT, SamplingParams(structured_outputs=constraint))
    assert err.value.field == field and str(err.value).startswith(field)


@pytest.mark.parametrize("constraint", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}])
def test_malformed_structured_outputs_params(constraint):
    with pytest.raises(FieldError):
        SamplingParams(structured_outputs=constraint)
