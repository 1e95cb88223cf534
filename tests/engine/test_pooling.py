"""Pooling (embedding) requests against HF transformers (4 layers, fp32): the last layer's
hidden state after the final norm, pooled (last token / mean) and L2-normalized — whole
prompts in one batch, next to a generating request in the same steps, chunked prefill, a
prefix-cached prompt, preemption."""

import pytest
import torch

from engine import LLM, PoolingParams, SamplingParams

NUM_LAYERS = 4
PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome. The capital of Spain is",
    "def add(a, b):\n    return a + b\n",
    "Hi",
]
LAST, MEAN = PoolingParams(), PoolingParams(pooling_type="mean")
TOL = 1e-5


@pytest.fixture(scope="module")
def tok(model_dir):
    from engine.processing.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hidden(model_dir, tok):
    """Per prompt: HF's final-normed last-layer hidden states [T, dim] (fp32)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(
        model_dir, num_hidden_layers=NUM_LAYERS, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        return {p: hf.model(torch.tensor([tok.encode(p)])).last_hidden_state[0] for p in PROMPTS}


def reference(states: torch.Tensor, pooling: PoolingParams) -> torch.Tensor:
    pooled = states[-1] if pooling.pooling_type == "last" else states.mean(0)
    return torch.nn.functional.normalize(pooled, dim=-1) if pooling.normalize else pooled


def _llm(model_dir, **engine_args):
    return LLM(
        str(model_dir),
        num_layers=NUM_LAYERS,
        dtype="float32",
        kv_cache_memory=64 << 20,
        **engine_args,
    )


def _check(outs, hidden, pooling, prompts=PROMPTS):
    for prompt, out in zip(prompts, outs, strict=True):
        ref = reference(hidden[prompt], pooling)
        got = torch.tensor(out.embedding)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item()), prompt
        if pooling.normalize:
            assert got.norm().item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    "pooling",
    [
        LAST,
        MEAN,
        PoolingParams(normalize=False),
        PoolingParams(pooling_type="mean", normalize=False),
    ],
    ids=["last", "mean", "last-raw", "mean-raw"],
)
def test_pooling_matches_transformers(model_dir, hidden, pooling):
    llm = _llm(model_dir)
    _check(llm.embed(PROMPTS, pooling), hidden, pooling)


def test_token_id_prompts_and_batching_with_generation(model_dir, tok, hidden):
    llm = _llm(model_dir)
    [plain] = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    engine = llm.engine
    gen = engine.add_request("gen", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"e{i}", tok.encode(prompt), SamplingParams(max_tokens=1), pooling=LAST)
    embeddings, tokens, step = {}, [], 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.embedding is not None:
                assert delta.finish_reason == "stop" and delta.token_ids == []
                embeddings[delta.request_id] = (step, delta)
            elif delta.request_id == "gen":
                tokens += delta.token_ids
        step += 1
    # All prompts ran in the first step, the generating one's prefill included.
    assert {s for s, _ in embeddings.values()} == {0} and step == 4
    assert tokens == plain.outputs[0].token_ids and gen.num_output_tokens == 4
    _check([embeddings[f"e{i}"][1] for i in range(3)], hidden, LAST)


@pytest.mark.parametrize("pooling", [LAST, MEAN], ids=["last", "mean"])
def test_pooling_with_chunked_prefill(model_dir, hidden, pooling):
    llm = _llm(model_dir, max_num_batched_tokens=7)
    _check(llm.embed(PROMPTS, pooling), hidden, pooling)


def test_prefix_cached_prompt(model_dir, hidden):
    """Last-token pooling reuses cached blocks (only the last position is needed); mean
    pooling computes the whole prompt again."""
    llm = _llm(model_dir, block_size=8)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    last = llm.embed(PROMPTS[:2], LAST)
    assert all(o.num_cached_tokens > 0 for o in last)
    _check(last, hidden, LAST, PROMPTS[:2])
    mean = llm.embed(PROMPTS[:2], MEAN)
    assert all(o.num_cached_tokens == 0 for o in mean)
    _check(mean, hidden, MEAN, PROMPTS[:2])
    # A second embedding of the same prompt hits the blocks the first one cached.
    assert llm.embed(PROMPTS[:1], LAST)[0].num_cached_tokens > 0


def test_mean_pooling_survives_preemption(model_dir, hidden):
    block_bytes = NUM_LAYERS * 2 * 16 * 3 * 64 * 4
    llm = LLM(
        str(model_dir),
        num_layers=NUM_LAYERS,
        dtype="float32",
        kv_cache_memory=3 * block_bytes,
        max_num_batched_tokens=2,
    )
    engine = llm.engine
    # A long generation first; the embedding arrives later, prefills one token per step and
    # is preempted when the generation's growth takes the block it needs.
    engine.add_request(
        "gen", PROMPTS[2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    engine.add_request("emb", PROMPTS[0], SamplingParams(max_tokens=1), pooling=MEAN)
    out = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.embedding is not None:
                out = delta
    assert engine.stats().num_preemptions > 0
    _check([out], hidden, MEAN, PROMPTS[:1])
