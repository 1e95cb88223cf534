"""Replays the recorded vLLM behaviour (vllm_behaviour.py) against a real pdserve cluster:
each request must get vLLM's status, error field, or response semantics."""
import httpx
import pytest

from openai_cluster import KEY, MODEL
from vllm_behaviour import CASES, Case, Vocab, lookup

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vocab(reference):
    tok = reference.tokenizer
    [paris], [paris_bare] = tok.encode(" Paris"), tok.encode("Paris")
    return Vocab(eos=tok.eos_token_id, paris=paris, paris_bare=paris_bare,
                 emoji_head=tok.encode("😀")[0], vocab_size=tok.vocab_size)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_behaves_like_vllm(e2e, vocab, case: Case):
    body = {"model": MODEL, **case.body(vocab)}
    r = httpx.post(e2e.url + case.path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    doc = r.json()
    assert r.status_code == case.status, (case.why, doc)
    if case.status >= 400:
        error = doc["error"]
        assert error["param"] == case.param, (case.why, error)
        assert error["message"] and error["type"] == "invalid_request_error", error
        return
    for path, expected in case.expect.items():
        value = lookup(doc, path)
        if callable(expected):
            assert expected(value), (case.why, path, value)
        else:
            assert value == expected, (case.why, path, value)
