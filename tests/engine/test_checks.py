"""engine.checks: every frozen config / request dataclass refuses a bad field the same way,
naming it in `FieldError.field` (callers never parse the message)."""

import pytest

from engine.checks import FieldError, check_fields
from engine.config import EngineConfig
from engine.sampling.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "make, field, message",
    [
        (lambda: SamplingParams(top_p=1.5), "top_p", "top_p must be in (0, 1], got 1.5"),
        (
            lambda: SamplingParams(max_tokens=2, min_tokens=3),
            "min_tokens",
            "min_tokens must be <= max_tokens, got 3",
        ),
        (
            lambda: EngineConfig(block_size=7),
            "block_size",
            "block_size must be 8, 16, 32, 64 or 128, got 7",
        ),
    ],
)
def test_a_bad_field_is_named(make, field, message):
    with pytest.raises(FieldError) as info:
        make()
    assert info.value.field == field and str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_the_first_failing_rule_wins():
    class Obj:
        a, b = 1, 2

    check_fields(Obj, [(True, "a", "must hold")])
    with pytest.raises(FieldError, match="^b must be odd, got 2$"):
        check_fields(Obj, [(True, "a", "never"), (False, "b", "must be odd"), (False, "a", "x")])
