"""KV blocks one long sequence holds on a model whose every layer slides (Mistral layout),
with the engine releasing the blocks behind the window (the default) and without (the same
engine told not to) — measured: the peak of blocks in use over the run's steps — plus the
greedy tokens of both, which must be equal (the window already hides those blocks).

    python -m benchmarks.window_memory [--prompt-tokens 8000] [--window 512]
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import torch

from engine import LLM, SamplingParams
from engine.models.prepare import default_model_dir


def _checkpoint(out: Path, window: int, max_positions: int) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
        max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=None,
        pad_token_id=None))
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(default_model_dir() / name, out / name)
    return out


def _run(path: Path, prompt: list[int], max_tokens: int, release: bool) -> tuple[int, list[int], int]:
    """(peak blocks in use, greedy tokens, pool blocks)."""
    keep_all = mock.patch("engine.llm_engine._releasable_window", lambda args, config: None)
    with keep_all if not release else contextlib.nullcontext():
        llm = LLM(str(path), dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=512)
    bm, peak = llm.engine.block_manager, 0
    inner = llm.engine.step

    def step():
        nonlocal peak
        out = inner()
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        return out

    llm.engine.step = step
    [res] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True), use_tqdm=False)
    return peak, list(res.outputs[0].token_ids), bm.num_blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=512)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = _checkpoint(Path(tmp) / "mistral", a.window, a.prompt_tokens + a.max_tokens + 64)
        prompt = [(i * 7919) % 40000 + 100 for i in range(a.prompt_tokens)]
        kept, tokens_kept, pool = _run(path, prompt, a.max_tokens, release=False)
        released, tokens_released, _ = _run(path, prompt, a.max_tokens, release=True)
    total = -(-(a.prompt_tokens + a.max_tokens) // 16)
    print(f"one sequence of {a.prompt_tokens} + {a.max_tokens} tokens, window {a.window}, "
          f"block size 16, pool {pool} blocks, max_num_batched_tokens 512 (measured peaks)")
    print(f"without release: {kept} blocks held (the whole history: {total})")
    print(f"with release:    {released} blocks held")
    print(f"ratio: {kept / released:.1f}x fewer blocks; same greedy tokens: {tokens_kept == tokens_released}")


if __name__ == "__main__":
    main()
