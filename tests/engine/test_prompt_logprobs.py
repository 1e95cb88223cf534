"""prompt_logprobs against the log-softmax of an HF transformers forward over the prompt
(4 layers, fp32): whole prompts, chunked prefill, and a prompt whose blocks are already in
the prefix cache (a prompt-logprobs request computes it anyway)."""

import pytest
import torch

from engine import LLM, SamplingParams

NUM_LAYERS = 4
K = 3
PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome. The capital of Spain is",
    "def add(a, b):\n    return a + b\n",
    "Hi",
]


@pytest.fixture(scope="module")
def tok(model_dir):
    from engine.processing.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def references(model_dir, tok):
    """Per prompt: [token i's (logprob, top-K ids, rank)] for i = 1..n-1."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(
        model_dir, num_hidden_layers=NUM_LAYERS, dtype=torch.float32
    ).eval()
    refs = {}
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.inference_mode():
            logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        rows = []
        for i in range(1, len(ids)):
            lp = logprobs[i - 1]
            rows.append(
                (lp[ids[i]].item(), lp.topk(K).indices.tolist(), int((lp >= lp[ids[i]]).sum()))
            )
        refs[prompt] = rows
    return refs


def _llm(model_dir, **engine_args):
    return LLM(
        str(model_dir),
        num_layers=NUM_LAYERS,
        dtype="float32",
        kv_cache_memory=64 << 20,
        **engine_args,
    )


def _check(outs, tok, references, prompts=PROMPTS):
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok.encode(prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids), prompt
        for i, (lp, (ref_lp, ref_top, ref_rank)) in enumerate(
            zip(out.prompt_logprobs[1:], references[prompt]), 1
        ):
            assert lp.token_id == ids[i]
            assert lp.logprob == pytest.approx(ref_lp, abs=2e-3), (prompt, i)
            assert [t for t, _ in lp.top] == ref_top, (prompt, i)
            assert lp.rank == ref_rank, (prompt, i)


PARAMS = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)


def test_prompt_logprobs_match_transformers(model_dir, tok, references):
    llm = _llm(model_dir)
    outs = llm.generate(
        PROMPTS,
        [PARAMS, PARAMS, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0, n=2)],
        use_tqdm=False,
    )
    _check(outs[:2], tok, references, PROMPTS[:2])
    assert outs[2].prompt_logprobs == [None]  # one prompt token: nothing to score
    [plain] = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert plain.prompt_logprobs is None
    # The sampled tokens are unaffected by the extra logits.
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_prompt_logprobs_with_chunked_prefill(model_dir, tok, references):
    llm = _llm(model_dir, max_num_batched_tokens=7)
    _check(llm.generate(PROMPTS, PARAMS, use_tqdm=False), tok, references)


def test_a_prefix_cached_prompt_is_computed_again_for_prompt_logprobs(model_dir, tok, references):
    llm = _llm(model_dir, block_size=8)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # caches
    [again] = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert again.num_cached_tokens > 0
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in outs)
    _check(outs, tok, references)


def test_prompt_logprobs_survive_preemption(model_dir, tok, references):
    block_bytes = NUM_LAYERS * 2 * 16 * 3 * 64 * 4
    llm = LLM(
        str(model_dir),
        num_layers=NUM_LAYERS,
        dtype="float32",
        kv_cache_memory=4 * block_bytes,
        max_num_batched_tokens=8,
    )
    params = SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=K, ignore_eos=True)
    prompts = PROMPTS[::-1]  # the newest (preempted first) has the longest prompt
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    _check(outs, tok, references, prompts)
