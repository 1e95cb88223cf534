"""The issue's key check: greedy with min_tokens = max_tokens = n equals HF transformers'
generate(min_new_tokens=n, max_new_tokens=n) on a prompt where the (full, fp32) model would
otherwise end within a few tokens. Also the EOS text rule (skip_special_tokens=False)."""

import pytest
import torch

from engine import LLM, SamplingParams

N = 16
QUESTION = "What is 2+2? Answer with a number only."


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])


def _hf_greedy(model_dir, prompt, **kwargs):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=N, **kwargs)
    return out[0, len(prompt) :].tolist()


def test_min_tokens_matches_hf_min_new_tokens(llm, model_dir, prompt):
    eos = llm.tokenizer.eos_token_id
    [early] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)
    assert early.outputs[0].finish_reason == "stop" and len(early.outputs[0].token_ids) <= N // 2
    assert early.outputs[0].token_ids[-1] == eos and early.outputs[0].stop_reason is None

    [forced] = llm.generate(
        [prompt], SamplingParams(temperature=0, min_tokens=N, max_tokens=N), use_tqdm=False
    )
    ours = forced.outputs[0]
    reference = _hf_greedy(model_dir, prompt, min_new_tokens=N)
    assert ours.token_ids == reference
    assert len(ours.token_ids) == N and eos not in ours.token_ids and ours.finish_reason == "length"
    # The forced tokens continue the early answer (same prefix, EOS masked where it came).
    assert ours.token_ids[: len(early.outputs[0].token_ids) - 1] == early.outputs[0].token_ids[:-1]


def test_eos_text_is_left_out_even_when_special_tokens_are_shown(llm, prompt):
    answer = "2 + 2 = 4"
    for include, text in [(False, answer), (True, answer + "<|im_end|>")]:
        params = SamplingParams(
            temperature=0,
            max_tokens=N,
            skip_special_tokens=False,
            include_stop_str_in_output=include,
        )
        [out] = llm.generate([prompt], params, use_tqdm=False)
        assert (out.outputs[0].text, out.outputs[0].finish_reason) == (text, "stop")
