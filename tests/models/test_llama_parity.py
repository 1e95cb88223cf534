"""Our LLaMA implementation against transformers' LlamaForCausalLM on the same prepared
weights: logits (fp32, max abs diff <= 1e-3) and 32-token greedy continuations."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata, TorchAttentionBackend
from engine.models.interface import ForwardContext
from engine.models.loader import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far, far away, there lived a dragon who",
    "Liste des nombres premiers : 2, 3, 5, 7,",
]


def _hf(model_dir, num_layers):
    from transformers import LlamaForCausalLM

    kwargs = {} if num_layers is None else {"num_hidden_layers": num_layers}
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


@torch.inference_mode()
def _our_logits(loaded, ids):
    args = loaded.args
    n = len(ids)
    num_blocks = -(-n // 16)
    kv = torch.zeros(num_blocks, args.n_kv_heads, args.n_layers, 2, 16, args.head_dim)  # HND
    meta = AttentionMetadata.single_sequence(0, n, 16, num_blocks)
    return loaded.model(
        torch.tensor(ids), torch.arange(n), ForwardContext(TorchAttentionBackend(), kv, meta)
    )


def _check(model_dir, num_layers, prompts):
    llm = LLM(str(model_dir), num_layers=num_layers, kv_cache_memory=64 << 20, dtype="float32")
    ours = llm.engine.loaded  # the engine's model, called directly for logits (no second load)
    hf = _hf(model_dir, num_layers)
    for prompt in prompts:
        ids = ours.tokenizer.encode(prompt)
        with torch.inference_mode():
            ref_logits = hf(torch.tensor([ids])).logits[0]
        diff = (_our_logits(ours, ids) - ref_logits).abs().max().item()
        assert diff <= 1e-3, f"{prompt!r}: max |logit diff| {diff}"

        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[
                0, len(ids) :
            ]
        [out] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
        assert out.outputs[0].token_ids == ref.tolist(), prompt


def test_truncated_model_matches_transformers(model_dir):
    _check(model_dir, 4, PROMPTS)


@pytest.mark.slow
def test_full_model_matches_transformers(model_dir):
    _check(model_dir, None, PROMPTS[:2])


def test_gguf_loads_directly_with_the_same_weights(model_dir):
    from engine.models.prepare import bundled_gguf_path

    from_dir = load_model(model_dir, num_layers=2)
    from_gguf = load_model(bundled_gguf_path(), num_layers=2)
    a, b = from_dir.model.state_dict(), from_gguf.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert from_gguf.tokenizer.encode("Hello 123") == from_dir.tokenizer.encode("Hello 123")
