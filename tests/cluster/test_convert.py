"""cluster/convert.py: SamplingParams survive the wire both ways (structured outputs included:
a JSON schema travels as JSON text; reasoning markers as token ids, absent as None)."""

import json

import pytest

from cluster.convert import sampling_from_pb, sampling_to_pb, structured_from_pb, structured_to_pb
from engine.checks import FieldError
from engine.sampling.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams as S
from proto import pdserve_pb2 as pb

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_plain_sampling_round_trips():
    p = SamplingParams(
        n=2,
        temperature=0.75,
        top_k=5,
        top_p=0.5,
        min_p=0.125,
        seed=7,
        max_tokens=9,
        min_tokens=1,
        stop=("x",),
        stop_token_ids=(3,),
        logprobs=2,
        logit_bias={5: 1.5},
        allowed_token_ids=(1, 2),
        bad_words=("no",),
        prompt_logprobs=1,
        truncate_prompt_tokens=4,
    )
    assert sampling_from_pb(sampling_to_pb(p)) == p
    assert not sampling_to_pb(p).HasField("structured_outputs")


@pytest.mark.parametrize(
    "so",
    [
        S(regex="[0-9]{3}"),
        S(choice=("yes", "no")),
        S(grammar='root ::= "a" | "b"'),
        S(json_object=True),
        S(json=json.dumps(SCHEMA), disable_any_whitespace=True),
        S(
            structural_tag='{"type": "structural_tag", "format": '
            '{"type": "const_string", "value": "x"}}'
        ),
        S(regex="a", disable_additional_properties=True, disable_fallback=True),
        S(choice=("yes", "no"), reasoning_start=(151667,), reasoning_end=(198, 151668)),
    ],
)
def test_structured_outputs_round_trip(so):
    p = SamplingParams(max_tokens=4, structured_outputs=so)
    m = sampling_to_pb(p)
    assert sampling_from_pb(m) == p
    assert sampling_to_pb(sampling_from_pb(m)) == m


def test_a_schema_object_travels_as_json_text():
    p = SamplingParams(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    m = sampling_to_pb(p)
    assert m.structured_outputs.WhichOneof("constraint") == "json"
    assert json.loads(m.structured_outputs.json) == SCHEMA
    back = sampling_from_pb(m).structured_outputs
    assert back.json == json.dumps(SCHEMA) and back.disable_any_whitespace  # order kept


def test_no_constraint_on_the_wire_is_invalid():
    with pytest.raises(FieldError):
        structured_from_pb(pb.StructuredOutputs(disable_any_whitespace=True))


def test_reasoning_markers_travel_as_token_ids():
    so = S(regex="[0-9]+", reasoning_start=(7,), reasoning_end=(8, 9))
    m = sampling_to_pb(SamplingParams(structured_outputs=so)).structured_outputs
    assert (list(m.reasoning_start), list(m.reasoning_end)) == ([7], [8, 9])
    back = structured_from_pb(m)
    assert (back.reasoning_start, back.reasoning_end) == ((7,), (8, 9))
    plain = structured_from_pb(structured_to_pb(S(regex="[0-9]+")))
    assert (plain.reasoning_start, plain.reasoning_end) == (None, None)
    del m.reasoning_start[:]  # one marker without the other is invalid
    with pytest.raises(FieldError) as err:
        structured_from_pb(m)
    assert err.value.field == "reasoning_start"
