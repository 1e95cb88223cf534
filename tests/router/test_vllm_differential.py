"""Replays the recorded vLLM behaviour (vllm_behaviour.py) against a real pdserve cluster,
through the official `openai` client (vLLM's extra fields in `extra_body`, as its users send
them): each request must get vLLM's status, error field, or response semantics."""

import openai
import pytest
from openai_cluster import MODEL
from vllm_behaviour import CASES, CHAT, Case, Vocab, lookup

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vocab(reference):
    tok = reference.tokenizer
    [paris], [paris_bare] = tok.encode(" Paris"), tok.encode("Paris")
    return Vocab(
        eos=tok.eos_token_id, paris=paris, paris_bare=paris_bare, vocab_size=tok.vocab_size
    )


def _send(client: openai.OpenAI, case: Case, vocab: Vocab) -> dict:
    body = case.body(vocab)
    if case.path == CHAT:
        messages = body.pop("messages")
        return client.chat.completions.create(
            model=MODEL, messages=messages, extra_body=body
        ).model_dump()
    prompt = body.pop("prompt")
    return client.completions.create(model=MODEL, prompt=prompt, extra_body=body).model_dump()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_behaves_like_vllm(client, vocab, case: Case):
    if case.status >= 400:
        with pytest.raises(openai.APIStatusError) as refused:
            _send(client, case, vocab)
        assert refused.value.status_code == case.status, case.why
        error = refused.value.body
        assert error["param"] == case.param, (case.why, error)
        assert error["message"] and error["type"] == "invalid_request_error", error
        return
    doc = _send(client, case, vocab)
    for path, expected in case.expect.items():
        value = lookup(doc, path)
        if callable(expected):
            assert expected(value), (case.why, path, value)
        else:
            assert value == expected, (case.why, path, value)
