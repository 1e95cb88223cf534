"""KV memory one long sequence holds with the engine releasing the blocks behind each
sliding window (the default) and without (the same engine, same KV groups, told not to) —
measured: the peak of blocks in use over the run's steps, in bytes — plus the greedy tokens of
both, which must be equal (the windows already hide those blocks). Two layouts: `mistral`
(every layer slides: one KV group) and `gemma3` (Gemma 3's five sliding layers to one global:
one full-attention group and five sliding ones).

    python benchmarks/window_memory.py [--arch mistral|gemma3] [--prompt-tokens 8000] [--window 512]
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


def _checkpoint(out: Path, arch: str, window: int, max_positions: int) -> Path:
    common = dict(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=window,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    if arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        hf = MistralForCausalLM(MistralConfig(num_hidden_layers=2, **common))
    else:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        hf = Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=6, head_dim=32, **common))
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(default_model_dir() / name, out / name)
    return out


def _run(
    path: Path, prompt: list[int], max_tokens: int, release: bool
) -> tuple[int, list[int], int]:
    """(peak KV bytes in use, greedy tokens, pool blocks)."""
    keep_all = mock.patch(
        "engine.llm_engine._group_windows",
        lambda args, config: (None,) * args.kv_groups().num_groups,
    )
    with keep_all if not release else contextlib.nullcontext():
        llm = LLM(str(path), dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=512)
    bm, peak = llm.engine.block_manager, 0
    inner = llm.engine.step

    def step():
        nonlocal peak
        out = inner()
        peak = max(peak, bm.pool.num_blocks - bm.pool.num_free_blocks)
        return out

    llm.engine.step = step
    [res] = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    block_bytes = llm.engine.kv_cache[0].nbytes
    return peak * block_bytes, list(res.outputs[0].token_ids), bm.pool.num_blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=("mistral", "gemma3"), default="mistral")
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=512)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = _checkpoint(
            Path(tmp) / a.arch, a.arch, a.window, a.prompt_tokens + a.max_tokens + 64
        )
        prompt = [(i * 7919) % 40000 + 100 for i in range(a.prompt_tokens)]
        kept, tokens_kept, pool = _run(path, prompt, a.max_tokens, release=False)
        released, tokens_released, _ = _run(path, prompt, a.max_tokens, release=True)
    mib = 1 << 20
    print(
        f"{a.arch}: one sequence of {a.prompt_tokens} + {a.max_tokens} tokens, window {a.window}, "
        f"block size 16, pool {pool} blocks, max_num_batched_tokens 512 (measured peaks)"
    )
    print(f"without release: {kept / mib:.2f} MiB of KV held")
    print(f"with release:    {released / mib:.2f} MiB of KV held")
    print(
        f"ratio: {kept / released:.2f}x less; same greedy tokens: {tokens_kept == tokens_released}"
    )


if __name__ == "__main__":
    main()
