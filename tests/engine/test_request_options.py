"""Per-request options through the whole engine (2-layer model, like test_sampling.py): stop
tokens and strings with stop_reason, priority, make_request's tokenization and validation,
and the offline API's generation-config defaults."""

import json

import pytest

from engine import LLM, SamplingParams

PROMPT = "In the beginning"  # greedy on 2 layers: " of" " a" "." " " "," ...


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_layers=2, kv_cache_memory=32 << 20, dtype="float32")


def _one(llm, **params):
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, **params), use_tqdm=False)
    return out.outputs[0]


@pytest.fixture(scope="module")
def greedy(llm):
    out = _one(llm, max_tokens=3)
    assert [llm.tokenizer.decode([t]) for t in out.token_ids] == [" of", " a", "."]
    return out


def test_stop_token_text_is_left_out_unless_include_stop_str_in_output(llm, greedy):
    a = greedy.token_ids[1]
    plain = _one(llm, max_tokens=10, stop_token_ids=(a,))
    kept = _one(llm, max_tokens=10, stop_token_ids=(a,), include_stop_str_in_output=True)
    for out, text in [(plain, " of"), (kept, " of a")]:
        assert out.token_ids == greedy.token_ids[:2]  # the stop token id stays
        assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", a)


def test_stop_strings_report_themselves_and_may_stay_in_the_text(llm):
    plain = _one(llm, max_tokens=10, stop=["f a"])
    kept = _one(llm, max_tokens=10, stop=["f a"], include_stop_str_in_output=True)
    assert (plain.text, plain.stop_reason, plain.finish_reason) == (" o", "f a", "stop")
    assert (kept.text, kept.stop_reason, kept.finish_reason) == (" of a", "f a", "stop")
    length = _one(llm, max_tokens=2)
    assert (length.finish_reason, length.stop_reason) == ("length", None)


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm, greedy):
    out = _one(llm, max_tokens=3, stop=["a."])
    assert out.token_ids == greedy.token_ids
    assert (out.text, out.finish_reason, out.stop_reason) == (" of ", "stop", "a.")


def test_min_tokens_holds_stop_tokens_and_strings_back(llm, greedy):
    a = greedy.token_ids[1]
    masked = _one(llm, max_tokens=3, min_tokens=2, stop_token_ids=(a,))
    assert masked.token_ids[0] == greedy.token_ids[0] and masked.token_ids[1] != a
    assert _one(llm, max_tokens=3, stop=[" of"]).text == ""
    gated = _one(llm, max_tokens=3, min_tokens=1, stop=[" of"])  # " of" is the first token
    assert (gated.text, gated.finish_reason) == (greedy.text, "length")


def test_lower_priority_value_runs_first_with_one_slot(model_dir):
    one_slot = LLM(
        str(model_dir), num_layers=2, kv_cache_memory=32 << 20, max_num_seqs=1, dtype="float32"
    )
    engine = one_slot.engine
    params = SamplingParams(temperature=0, max_tokens=3)
    engine.add_request("background", PROMPT, params, priority=1)
    engine.add_request("urgent", PROMPT, params, priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [d.request_id for d in engine.step() if d.finished]
    assert finished == ["urgent", "background"]
    outs = one_slot.generate([PROMPT, PROMPT], params, use_tqdm=False, priority=[3, -3])
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        one_slot.generate([PROMPT, PROMPT], params, use_tqdm=False, priority=[0])


def test_make_request_tokenizes_bad_words_as_vllm_does(llm):
    tok = llm.tokenizer
    req = llm.engine.make_request("bw", PROMPT, SamplingParams(bad_words=("Hugging", " zebra")))
    # "Hugging": both spellings (different first token, same length); "zebra" (left-stripped)
    # with a space is one token instead of two: only the plain spelling.
    assert req.bad_words_token_ids == [
        tok.encode("Hugging"),
        tok.encode(" Hugging"),
        tok.encode("zebra"),
    ]
    assert len(tok.encode(" zebra")) != len(tok.encode("zebra"))
    out = _one(llm, max_tokens=3, bad_words=("a",))  # " a" was the greedy second token
    assert llm.tokenizer.encode(" a")[0] not in out.token_ids


def test_make_request_validates_ids_and_truncates_prompts(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match=r"^logit_bias token ids must be in \[0, 49152\)"):
        engine.make_request("x", PROMPT, SamplingParams(logit_bias={49152: 1.0}))
    with pytest.raises(ValueError, match=r"^allowed_token_ids token ids must be in \[0, 49152\)"):
        engine.make_request("x", PROMPT, SamplingParams(allowed_token_ids=[5, -1]))
    req = engine.make_request("x", list(range(10, 30)), SamplingParams(truncate_prompt_tokens=5))
    assert req.prompt_token_ids == list(range(25, 30))
    assert engine.make_request("x", PROMPT, SamplingParams(), priority=7).priority == 7


def test_generation_config_defaults(model_dir, tmp_path, llm):
    assert llm.get_default_sampling_params() == SamplingParams()  # the model sets none
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_k": 20, "max_new_tokens": 4, "eos_token_id": 2})
    )
    custom = LLM(
        str(model_dir), num_layers=2, kv_cache_memory=32 << 20, generation_config=str(tmp_path)
    )
    assert custom.get_default_sampling_params() == SamplingParams(
        temperature=0.0, top_k=20, max_tokens=4
    )
    [out] = custom.generate([PROMPT], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    vllm_defaults = LLM(
        str(model_dir), num_layers=2, kv_cache_memory=32 << 20, generation_config="vllm"
    )
    assert vllm_defaults.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation-config"):
        LLM(
            str(model_dir),
            num_layers=2,
            kv_cache_memory=32 << 20,
            generation_config=str(tmp_path / "no"),
        )


def test_generation_config_eos_ids_follow_vllm(model_dir):
    """The tokenizer's eos stops as EOS (stop_reason None); the generation config's other eos
    ids act as stop_token_ids (stop_reason = the id); with ignore_eos all are only masked."""
    from engine.processing.request_builder import RequestBuilder
    from engine.processing.tokenizer import Tokenizer

    tok = Tokenizer(
        (model_dir / "tokenizer.json").read_text(),
        json.loads((model_dir / "tokenizer_config.json").read_text()),
        {"eos_token_id": [2, 0]},
    )
    builder = RequestBuilder(tok, 49152, 1024, 16, seed=0)
    req = builder.build("a", "hi", SamplingParams(stop_token_ids=[7]))
    assert req.eos_token_ids == {2} and req.sampling.stop_token_ids == (7, 0)
    ignoring = builder.build("b", "hi", SamplingParams(ignore_eos=True, stop_token_ids=[7]))
    assert ignoring.eos_token_ids == {0, 2} and ignoring.sampling.stop_token_ids == (7,)


def test_prompt_logprobs_requests_are_not_parked_for_remote_kv(llm):
    engine = llm.engine
    wants = engine.make_request("pl", PROMPT, SamplingParams(prompt_logprobs=1))
    assert engine.add_remote_prefill_request(wants) is None  # the decode worker prefills it
    assert not engine.has_unfinished_requests()
    plain = engine.make_request("remote", PROMPT, SamplingParams())
    assert engine.add_remote_prefill_request(plain) is not None
    engine.abort_request("remote")
