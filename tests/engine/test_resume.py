"""A request resumed from prompt + k outputs (the router migrating it to another worker)
continues exactly as the uninterrupted request: the same remaining tokens (greedy and seeded,
with penalties and min_tokens), and the text streamed before the seam + after it is the
uninterrupted text (stop-string hold-back and characters split across tokens at the seam)."""

from dataclasses import dataclass, field, replace

import pytest

from engine import LLM, SamplingParams
from engine.processing.tokens import Resume


@dataclass
class _Run:
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # text delivered with each token's delta
    tail: str = ""  # text of a final delta without a token
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts) + self.tail


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_layers=2, kv_cache_memory=32 << 20, dtype="float32")


_ids = iter(range(10**6))


def _run(llm, prompt: list[int], params: SamplingParams, resume: Resume | None = None) -> _Run:
    engine = llm.engine
    request = engine.make_request(f"resume-{next(_ids)}", prompt, params, resume=resume)
    engine.submit(request)
    out = _Run()
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.token_ids:
                out.tokens += d.token_ids
                out.texts.append(d.text)
            else:
                out.tail += d.text
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
    return out


def _check_every_seam(llm, prompt: list[int], params: SamplingParams) -> _Run:
    whole = _run(llm, prompt, params)
    assert len(whole.tokens) > 3
    # Ended by its length, it may be resumed with every output too (only its end was lost):
    # it ends at once, with the text its detokenizer held back.
    seams = len(whole.tokens) + (whole.finish_reason == "length")
    for k in range(1, seams):
        sent = "".join(whole.texts[:k])
        rest = _run(llm, prompt, params, Resume(tuple(whole.tokens[:k]), len(sent)))
        assert whole.tokens[:k] + rest.tokens == whole.tokens, k
        assert sent + rest.text == whole.text, k
        assert (rest.finish_reason, rest.stop_reason) == (whole.finish_reason, whole.stop_reason)
    return whole


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenizer.encode("The weather today is", add_special_tokens=True)


def test_greedy_with_penalties_and_min_tokens(llm, prompt):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=14,
        min_tokens=8,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    _check_every_seam(llm, prompt, params)


def test_seeded_top_p_top_k_with_held_back_stop_text(llm, prompt):
    params = SamplingParams(
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        seed=1234,
        max_tokens=14,
        min_tokens=4,
        frequency_penalty=0.3,
        stop=["never appears here"],
    )
    whole = _check_every_seam(llm, prompt, params)
    # A stop string found after the seam (it may begin before it) still ends the request.
    stop = whole.text[len(whole.text) // 2 :][:4]
    stopped = _check_every_seam(llm, prompt, replace(params, stop=[stop]))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop


def test_multibyte_characters_split_at_the_seam(llm, prompt):
    tok = llm.tokenizer
    # 日 is two tokens (its bytes split), 本 one: text often waits for the second
    # half of 日, so some seams fall inside a character.
    pieces = tok.encode("日本")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16, allowed_token_ids=pieces)
    whole = _check_every_seam(llm, prompt, params)
    assert "" in whole.texts[:-1], "no seam fell inside a character"
    assert any(ord(ch) > 0xFFFF or "\u3000" <= ch <= "\u9fff" for ch in whole.text)


def test_a_resume_with_every_output_ends_at_once_with_the_held_back_text(llm, prompt):
    """The caller got all 6 tokens, the last without its end: the text of a stream that goes
    on (a stop string's hold-back kept the last characters) — which the resume releases."""
    params = SamplingParams(temperature=0.0, max_tokens=6, stop=["never appears here"])
    whole = _run(llm, prompt, params)
    assert whole.finish_reason == "length" and len(whole.tokens) == 6
    going_on = _run(llm, prompt, replace(params, max_tokens=7))
    assert going_on.tokens[:6] == whole.tokens
    sent = "".join(going_on.texts[:6])  # what the caller had: less than the whole text
    assert len(sent) < len(whole.text) and whole.text.startswith(sent)
    free = llm.engine.block_manager.pool.num_free_blocks
    rest = _run(llm, prompt, params, Resume(tuple(whole.tokens), len(sent)))
    assert (rest.tokens, rest.finish_reason) == ([], "length")
    assert sent + rest.tail == whole.text
    assert llm.engine.block_manager.pool.num_free_blocks == free  # nothing held


def test_bad_resumes_are_refused(llm, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="resume_output_token_ids"):
        llm.engine.make_request("bad-1", prompt, params, resume=Resume((5, 6, 7, 8, 9), 0))
    with pytest.raises(ValueError, match="resume_output_token_ids"):
        llm.engine.make_request("bad-2", prompt, replace(params, n=2), resume=Resume((5,), 0))
    request = llm.engine.make_request("bad-3", prompt, params, resume=Resume((5,), 1000))
    with pytest.raises(ValueError, match="resume_text_chars"):
        llm.engine.submit(request)
    assert not llm.engine.has_unfinished_requests()
