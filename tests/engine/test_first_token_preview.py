"""A decode worker sends a remote prefill's first token before its engine admits the request
(decode_node/prefill_client.py): `LLMEngine.preview_remote_first` must make exactly the delta
`finish_remote_prefill` makes later — text, stop strings and ids, length, min_tokens, EOS,
logprobs — and change nothing while making it. Checked against the engine itself on the
real tokenizer (2-layer model: no step runs here)."""

from __future__ import annotations

import itertools

import pytest

from engine import LLM, SamplingParams
from engine.core.request import RequestStatus
from engine.processing.tokens import SampledToken

PROMPT = "In the beginning"
_ids = itertools.count()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_layers=2, kv_cache_memory=32 << 20, dtype="float32")


def _token(llm, text: str) -> int:
    [token_id] = llm.tokenizer.encode(text, add_special_tokens=False)
    return token_id


def _preview_then_admit(llm, params: SamplingParams, token: SampledToken):
    """The preview, and the engine's own first delta for the same parked request."""
    engine = llm.engine
    free = engine.block_manager.pool.num_free_blocks
    rid = f"preview-{next(_ids)}"
    req = engine.make_request(rid, PROMPT, params)
    assert engine.add_remote_prefill_request(req) is not None
    before = (list(req.token_ids), req.status, list(req.logprobs), req.stop_reason)
    preview = engine.preview_remote_first(req, token)
    assert (list(req.token_ids), req.status, list(req.logprobs), req.stop_reason) == before
    assert req.status is RequestStatus.WAITING_FOR_KV
    [admitted] = engine.finish_remote_prefill(rid, token)
    engine.abort_request(rid)  # unfinished ones: nothing steps here
    assert engine.block_manager.pool.num_free_blocks == free  # nothing leaked either way
    return preview, admitted


CASES = {
    "a plain token": (dict(max_tokens=8), " of", None),
    "max_tokens 1": (dict(max_tokens=1), " of", "length"),
    "a stop string inside the token": (dict(max_tokens=8, stop=["f"]), " of", "stop"),
    "a stop string kept": (
        dict(max_tokens=8, stop=["f"], include_stop_str_in_output=True),
        " of",
        "stop",
    ),
    "a held-back prefix of a stop string": (dict(max_tokens=8, stop=["ofx"]), " of", None),
    "a stop token id": ("stop_token_ids", " of", "stop"),
    "a stop token id kept": ("stop_token_ids_kept", " of", "stop"),
    "min_tokens holds EOS back": ("eos_min_tokens", None, None),
    "EOS": ("eos", None, "stop"),
    "EOS ignored": ("eos_ignored", None, None),
}


def _params(llm, spec, text):
    """SamplingParams for a case (some need the token id or the EOS id)."""
    if isinstance(spec, dict):
        return SamplingParams(temperature=0, **spec)
    of = _token(llm, " of")
    return {
        "stop_token_ids": SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[of]),
        "stop_token_ids_kept": SamplingParams(
            temperature=0, max_tokens=8, stop_token_ids=[of], include_stop_str_in_output=True
        ),
        "eos_min_tokens": SamplingParams(temperature=0, max_tokens=8, min_tokens=2),
        "eos": SamplingParams(temperature=0, max_tokens=8),
        "eos_ignored": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    }[spec]


@pytest.mark.parametrize("case", list(CASES))
def test_the_preview_is_the_delta_admission_makes(llm, case):
    spec, text, finish = CASES[case]
    params = _params(llm, spec, text)
    req = llm.engine.make_request("probe", PROMPT, params)
    token_id = _token(llm, text) if text is not None else min(req.eos_token_ids)
    preview, admitted = _preview_then_admit(llm, params, SampledToken(token_id))
    assert preview == admitted
    assert preview.finish_reason == finish
    assert preview.token_ids == [token_id]


def test_logprobs_and_top_logprobs_are_previewed(llm):
    of, a = _token(llm, " of"), _token(llm, " a")
    token = SampledToken(of, -0.25, ((of, -0.25), (a, -1.5)), rank=1)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    preview, admitted = _preview_then_admit(llm, params, token)
    assert preview == admitted
    assert [(lp.token_id, lp.logprob, lp.top, lp.rank) for lp in preview.logprobs] == [
        (of, -0.25, [(of, -0.25), (a, -1.5)], 1)
    ]


def test_an_incomplete_character_previews_as_no_text(llm):
    """A token holding the first bytes of a multi-byte character has no text yet."""
    pieces = llm.tokenizer.encode("日本", add_special_tokens=False)
    first = pieces[0]
    preview, admitted = _preview_then_admit(
        llm, SamplingParams(temperature=0, max_tokens=8), SampledToken(first)
    )
    assert preview == admitted
    assert preview.text == llm.tokenizer.decode([first]).replace("\ufffd", "")


def test_a_request_with_a_grammar_is_not_previewed(llm):
    """Whether the grammar is complete after the token is its matcher's verdict, which only
    the engine thread advances: no preview (the token waits for admission)."""
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["of", "a"]})
    engine = llm.engine
    req = engine.make_request("grammar", PROMPT, params)
    assert req.grammar is not None
    assert engine.add_remote_prefill_request(req) is not None
    try:
        assert engine.preview_remote_first(req, SampledToken(_token(llm, "of"))) is None
    finally:
        engine.abort_request("grammar")
