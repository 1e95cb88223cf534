"""Greedy outputs of the paged engine, many prompts at once, token-identical to HF
transformers' generate() run one prompt at a time on the same (4-layer) weights — under the
default settings, chunked prefill, preemption and prefix caching."""

import pytest
import torch

from engine import LLM, SamplingParams

NUM_LAYERS = 4
MAX_TOKENS = 16
SHARED = (
    "You are a careful assistant. Answer briefly and precisely, and never invent facts. "
    "The user asks:"
)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4, 5,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy",
    "Translate to French: cheese ->",
    "In 1969, the first humans landed on",
    "Q: What is the boiling point of water at sea level?\nA:",
]
PREFIXED = [
    f"{SHARED} {q}"
    for q in (
        "What is 2+2?",
        "Name a color.",
        "Who wrote Hamlet?",
        "What is the capital of Italy?",
        "Say hello.",
        "Count to 3.",
        "What is water made of?",
        "Define gravity.",
    )
]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(
        model_dir, num_hidden_layers=NUM_LAYERS, dtype=torch.float32
    ).eval()


def _hf_greedy(hf_model, token_ids):
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([token_ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(token_ids) :].tolist()
    logprobs = [
        torch.log_softmax(step_logits[0].float(), -1)[t].item()
        for step_logits, t in zip(out.logits, tokens)
    ]
    return tokens, logprobs


@pytest.fixture(scope="module")
def references(hf_model, model_dir):
    from engine.processing.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return {p: _hf_greedy(hf_model, tok.encode(p)) for p in PROMPTS + PREFIXED}


def _run(model_dir, prompts, **engine_args):
    llm = LLM(str(model_dir), num_layers=NUM_LAYERS, dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def _assert_matches(outputs, prompts, references):
    for prompt, out in zip(prompts, outputs):
        ref_tokens, ref_logprobs = references[prompt]
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, prompt
        ours = [lp.logprob for lp in completion.logprobs]
        assert ours == pytest.approx(ref_logprobs, abs=2e-3), prompt
        for lp in completion.logprobs:  # top-2 alternatives, most likely first
            assert len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]


def test_default_settings(model_dir, references):
    _, outs = _run(model_dir, PROMPTS, kv_cache_memory=64 << 20)
    _assert_matches(outs, PROMPTS, references)


def test_chunked_prefill_with_a_tiny_token_budget(model_dir, references):
    llm, outs = _run(model_dir, PROMPTS, kv_cache_memory=64 << 20, max_num_batched_tokens=7)
    _assert_matches(outs, PROMPTS, references)


def test_preemption_under_a_tiny_pool(model_dir, references):
    block_bytes = NUM_LAYERS * 2 * 16 * 3 * 64 * 4
    llm, outs = _run(model_dir, PROMPTS, kv_cache_memory=8 * block_bytes)
    assert llm.engine.stats().num_preemptions > 0
    _assert_matches(outs, PROMPTS, references)


def test_prefix_caching_with_shared_prefixes(model_dir, references):
    llm = LLM(str(model_dir), num_layers=NUM_LAYERS, kv_cache_memory=64 << 20, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    llm.generate(PREFIXED[:1], params, use_tqdm=False)  # warms the shared prefix
    outs = llm.generate(PREFIXED, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 16 * (len(PREFIXED) - 1)
    assert all(o.num_cached_tokens >= 16 for o in outs)
    _assert_matches(outs, PREFIXED, references)


def test_prefix_caching_off_computes_everything(model_dir, references):
    llm, outs = _run(model_dir, PREFIXED, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    assert llm.engine.stats().prefix_cache_hits == 0
    _assert_matches(outs, PREFIXED, references)
