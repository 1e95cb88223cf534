"""IncrementalDetokenizer on the real tokenizer: streamed deltas against the tokenizer's own
full decode, and vLLM's stop-string rules (tests/detokenizer/test_min_tokens.py there)."""

import pytest

from engine.processing.detokenizer import IncrementalDetokenizer
from engine.processing.tokenizer import Tokenizer

SENTENCE = "Hello, my name is Lee, and I'm a student in the college of engineering"


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


def _stream(detok, ids, stop_terminated_last=False):
    """Feed tokens one by one as the engine does; (deltas, stop string or None)."""
    deltas, stop = [], None
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        stop = detok.append(token, stop_terminated_last and last)
        deltas.append(detok.take_delta(finished=stop is not None or last))
        if stop is not None:
            break
    return deltas, stop


@pytest.mark.parametrize(
    "text", ["日本語のテキストです。", "Party time 🎉👍 done", "naïve café 😀!"]
)
def test_multibyte_characters_split_across_tokens_stream_whole(tok, text):
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some character spans tokens
    deltas, stop = _stream(IncrementalDetokenizer(tok, True, ()), ids)
    assert stop is None
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_spanning_tokens_cuts_before_it_and_is_never_streamed(tok):
    ids = tok.encode(SENTENCE)
    stop = "e, an"  # " Lee" | "," | " and"
    deltas, found = _stream(IncrementalDetokenizer(tok, True, ("zzz", stop)), ids)
    assert found == stop
    assert "".join(deltas) == SENTENCE[: SENTENCE.index(stop)]
    assert not any("e, a" in d for d in deltas)


def test_include_stop_str_in_output_keeps_the_match_and_nothing_after(tok):
    ids = tok.encode(SENTENCE)
    stop = "stud"  # inside " student": the rest of that token is dropped
    detok = IncrementalDetokenizer(tok, True, (stop,), include_stop_str_in_output=True)
    deltas, found = _stream(detok, ids)
    assert found == stop
    assert "".join(deltas) == SENTENCE[: SENTENCE.index(stop) + len(stop)]
    assert detok.holdback == 0  # a kept stop string never cuts text already sent


@pytest.mark.parametrize("min_tokens", [0, 1, 5, 9])
def test_stop_strings_wait_for_min_tokens(tok, min_tokens):
    # vLLM's own case ("Hello, my name is" then the rest, stop "e"), on this tokenizer.
    ids = tok.encode(SENTENCE)[4:]
    full = tok.decode(ids)
    gated = len(tok.decode(ids[:min_tokens]))  # text of the first min_tokens tokens
    detok = IncrementalDetokenizer(tok, True, ("e",), min_tokens=min_tokens)
    deltas, found = _stream(detok, ids)
    assert found == "e"
    assert "".join(deltas) == full[: full.index("e", gated)]
    if min_tokens == 5:
        assert "".join(deltas) == " is Lee, and I'm a stud"  # vLLM's expected text


def test_a_stop_string_may_begin_in_gated_text_but_must_end_after_it(tok):
    ids = tok.encode(SENTENCE)  # Hello | , | my | name ...
    # "o, m" begins in the first two (gated) tokens and ends in the third.
    deltas, found = _stream(IncrementalDetokenizer(tok, True, ("o, m",), min_tokens=2), ids)
    assert found == "o, m" and "".join(deltas) == "Hell"
    # "llo" lies wholly in the gated text and never again: not a stop.
    deltas, found = _stream(IncrementalDetokenizer(tok, True, ("llo",), min_tokens=2), ids)
    assert found is None and "".join(deltas) == SENTENCE


def test_stop_token_text_is_left_out_unless_included(tok):
    ids = tok.encode(SENTENCE)[:6]  # ... " Lee" ends the request as a stop token
    for include, expected in [(False, "Hello, my name is"), (True, "Hello, my name is Lee")]:
        detok = IncrementalDetokenizer(tok, True, (), include_stop_str_in_output=include)
        deltas, _ = _stream(detok, ids, stop_terminated_last=True)
        assert "".join(deltas) == expected
