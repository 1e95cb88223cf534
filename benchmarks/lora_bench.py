"""Multi-LoRA benchmark (docs/lora.md). Decode throughput of a batch in which
every row uses a different adapter (as many adapters as rows, up to max_loras) against the
same batch on the base model, measured in one run, interleaved. Prints numbers and the ratio;
asserts nothing.

  python benchmarks/lora_bench.py [--batch 8] [--rank 16] [--steps 48] [--reps 2]

Adapters are random PEFT adapters (rank --rank on all seven projections: the most work an
adapter can add) written to a temporary directory with peft. Throughput = output tokens of
the batch / time of the decode steps after every row has its first token (prefill excluded).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from kv_dtype_bench import decode_tok_s as batch_decode_tok_s

from engine import LLM, LoRARequest

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, count: int, rank: int, root: Path) -> list[LoRARequest]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(
            base,
            LoraConfig(
                r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
            ),
        )
        model.save_pretrained(root / f"a{i}")
        base = model.unload()  # the bare base model again for the next adapter
        out.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return out


def decode_tok_s(llm: LLM, batch: int, steps: int, loras: list[LoRARequest | None]) -> float:
    prompts = [f"Story number {i}: once upon a time" for i in range(batch)]
    return batch_decode_tok_s(llm, prompts, steps, [loras[i % len(loras)] for i in range(batch)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.models.prepare import default_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        loras = make_adapters(default_model_dir(), args.batch, args.rank, Path(tmp))
        llm = LLM(
            dtype=args.dtype,
            num_layers=args.num_layers,
            enable_lora=True,
            max_loras=args.batch,
            max_lora_rank=args.rank,
            max_cpu_loras=args.batch,
            kv_cache_memory=1 << 30,
        )
        decode_tok_s(llm, args.batch, 4, loras)  # warm-up: load every adapter, fill the slots
        base, lora = [], []
        for _ in range(args.reps):
            base.append(decode_tok_s(llm, args.batch, args.steps, [None]))
            lora.append(decode_tok_s(llm, args.batch, args.steps, loras))
    print(
        f"dtype {llm.engine.dtype}, {args.threads} thread(s), batch {args.batch}, "
        f"{args.batch} adapters of rank {args.rank} on all 7 projections, {args.steps} decode steps"
    )
    print(
        f"base model        {max(base):8.1f} tok/s   (reps: {', '.join(f'{b:.1f}' for b in base)})"
    )
    print(
        f"one adapter/row   {max(lora):8.1f} tok/s   (reps: {', '.join(f'{x:.1f}' for x in lora)})"
    )
    print(
        f"ratio {max(lora) / max(base):.2f}x (per rep: "
        f"{', '.join(f'{x / b:.2f}' for x, b in zip(lora, base))})"
    )


if __name__ == "__main__":
    main()
