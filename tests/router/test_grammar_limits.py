"""A constraint that compiles for too long (router/generation/structured.py Grammars, in a child
process: engine/structured/compile_process.py) is a 400 at the compile time limit: its process
is killed, the next constraint compiles in a fresh one, and the same constraint again is
refused at once."""

import asyncio
import time

import pytest

from router.config import RouterConfig
from router.endpoints.completions.protocol import CompletionRequest
from router.generation.structured import Grammars, constraint
from router.http.errors import APIError
from router.server import load_model_card

# 60 bytes that xgrammar compiles for 10.8 s on the 2-core box (nested counted repetitions in
# a pattern; not monotonic: four levels, or {0,30}, are fast).
PATHOLOGICAL = {"type": "string", "pattern": "(((ab|a){0,20}){0,20}){0,20}"}
LIMIT_S = 1.0


@pytest.fixture(scope="module")
def grammars():
    card = load_model_card(RouterConfig(etcd="127.0.0.1:1"))
    # No repetition limit: PATHOLOGICAL (8000 nested copies) would be refused before any
    # compile (test_grammar_fairness.py); here it is the time limit that stops it.
    g = Grammars(card.tokenizer, card.vocab_size, processes=1, timeout_s=LIMIT_S, max_repetitions=0)
    yield g
    g.close()


def _check(grammars: Grammars, **fields) -> None:
    c = constraint(CompletionRequest.model_validate({"prompt": "a", **fields}))
    asyncio.run(grammars.check(c))


def test_a_pathological_schema_is_a_400_at_the_time_limit(grammars, monkeypatch):
    _check(grammars, guided_regex="[0-9]+")  # the child is up: what follows is compile time
    start = time.monotonic()
    with pytest.raises(APIError) as refused:
        _check(grammars, guided_json=PATHOLOGICAL)
    took = time.monotonic() - start
    err = refused.value
    assert (err.status, err.param) == (400, "guided_json")
    assert f"did not compile within {LIMIT_S:g} s" in err.message
    assert took < 5 * LIMIT_S  # killed: unbounded, it compiles for 10 s
    _check(grammars, guided_regex="[a-z]{2}")  # a fresh child compiles the next one
    with pytest.raises(APIError, match="is not valid"):
        _check(grammars, guided_regex="(unclosed")
    # The same schema again, from another field: refused from the cache, not compiled again.
    monkeypatch.setattr(grammars, "_compile", lambda *a: pytest.fail("compiled again"))
    with pytest.raises(APIError) as again:
        _check(
            grammars,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": PATHOLOGICAL},
            },
        )
    assert again.value.param == "response_format" and "did not compile" in again.value.message
