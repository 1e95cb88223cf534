"""Qwen2, Qwen3 and LLaMA with attention biases against transformers' own classes on tiny random 2-layer checkpoints (fp32,
GQA; Qwen3 with head_dim != hidden / heads): prefill logits and greedy continuations through
the engine. The bundled model lends its tokenizer; the weights are drawn here, biases and
norm weights included (transformers initialises those to 0 and 1, which would hide a
mapping mistake)."""
import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata, TorchAttentionBackend
from engine.models.interface import ForwardContext
from engine.models.loader import load_model

PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 5e5}))


def _llama_with_biases():
    """LLaMA with `attention_bias` (q/k/v and o biases): the engine used to drop them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**COMMON, attention_bias=True, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1e4}))


def _write(hf, model_dir, out):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    hf.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(model_dir / name, out / name)
    return out


@torch.inference_mode()
def _our_logits(loaded, ids):
    args, n = loaded.args, len(ids)
    num_blocks = -(-n // 16)
    kv = torch.zeros(num_blocks, args.n_layers, 2, 16, args.n_kv_heads, args.head_dim)
    meta = AttentionMetadata.single_sequence(0, n, 16, num_blocks)
    return loaded.model(torch.tensor(ids), torch.arange(n), ForwardContext(TorchAttentionBackend(), kv, meta))


@pytest.mark.parametrize("build, head_dim, ours_class", [
    (_qwen2, 16, "Qwen2ForCausalLM"), (_qwen3, 32, "Qwen3ForCausalLM"),
    (_llama_with_biases, 16, "Transformer")], ids=["qwen2", "qwen3", "llama-attention-bias"])
def test_matches_transformers(build, head_dim, ours_class, model_dir, tmp_path):
    hf = build().eval()
    out = _write(hf, model_dir, tmp_path / "model")
    ours = load_model(out)
    assert type(ours.model).__name__ == ours_class
    assert ours.args.head_dim == head_dim  # Qwen3's config.json head_dim, not 64 // 4
    llm = LLM(str(out), kv_cache_memory=16 << 20, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        with torch.inference_mode():
            ref_logits = hf(torch.tensor([ids])).logits[0]
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
        diff = (_our_logits(ours, ids) - ref_logits).abs().max().item()
        assert diff <= 1e-4, f"{prompt!r}: max |logit diff| {diff}"
        [res] = llm.generate([ids], params, use_tqdm=False)
        assert res.outputs[0].token_ids == ref.tolist(), prompt
