"""Paged-engine benchmarks (issue: the paged engine). Prints numbers and ratios measured in
one run against a baseline from the same run; asserts nothing.

  python -m benchmarks.engine_bench [--quick] [--only throughput,kv,prefix,overhead]

- throughput: N prompts of 128-512 tokens, 128 output tokens each, ignore_eos: pdserve vs HF
  transformers static batching (one left-padded batch), same model, same threads.
- kv: share of allocated KV slots holding real tokens, sampled every step of that run.
- prefix: a 4,000-token shared prefix + 50 new tokens: prefill tokens computed, TTFT cached
  vs uncached.
- overhead: CPU time per engine step outside the model forward, at 1 and 64 running sequences.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from engine import LLM, SamplingParams


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def bench_throughput(args) -> None:
    prompts = _prompts(args.num_prompts, 128, 512)
    out_len = args.output_len
    llm = LLM(args.model, num_layers=args.num_layers, kv_cache_memory=args.kv_memory)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    engine = llm.engine
    usage_samples: list[float] = []
    original_step = engine.step

    def sampling_step():
        deltas = original_step()
        running = engine.scheduler.running
        slots = sum(len(engine.block_manager.block_table(r.request_id)) for r in running)
        if slots:
            real = sum(r.num_computed_tokens for r in running)
            usage_samples.append(real / (slots * engine.block_manager.block_size))
        return deltas

    engine.step = sampling_step
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    ours_s = time.perf_counter() - t0
    engine.step = original_step
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    total = generated + sum(len(p) for p in prompts)

    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(
        str(llm.engine.loaded.model_dir), dtype=torch.float32,
        **({"num_hidden_layers": args.num_layers} if args.num_layers else {}),
    ).eval()
    width = max(len(p) for p in prompts)
    pad = 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf_out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
            do_sample=False, pad_token_id=pad,
        )
    hf_s = time.perf_counter() - t0
    hf_generated = (hf_out.shape[1] - width) * len(prompts)

    print(f"\n== offline throughput: {len(prompts)} prompts of 128-512 tokens, {out_len} out ==")
    print(f"pdserve: {ours_s:7.1f} s  {generated / ours_s:8.1f} output tok/s  {total / ours_s:8.1f} total tok/s")
    print(f"HF static batch: {hf_s:7.1f} s  {hf_generated / hf_s:8.1f} output tok/s")
    print(f"ratio pdserve / HF (output tok/s): {(generated / ours_s) / (hf_generated / hf_s):.2f}x  (target >= 3x)")
    if usage_samples:
        mean = sum(usage_samples) / len(usage_samples)
        print(f"\n== KV memory: slots holding real tokens ==\nmean {mean:.1%} over {len(usage_samples)} "
              f"steps, min {min(usage_samples):.1%}  (target >= 95%)")


def bench_prefix(args) -> None:
    llm = LLM(args.model, num_layers=args.num_layers, kv_cache_memory=args.kv_memory)
    engine = llm.engine
    rng = random.Random(1)
    shared = [rng.randrange(100, 49000) for _ in range(args.prefix_len)]
    tails = [[rng.randrange(100, 49000) for _ in range(50)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def ttft(prompt):
        before = engine.stats().prompt_tokens
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t0, engine.stats().prompt_tokens - before

    uncached_s, uncached_tokens = ttft(shared + tails[0])
    cached_s, cached_tokens = ttft(shared + tails[1])
    engine.reset_prefix_cache()
    cold_s, _ = ttft(shared + tails[2])
    print(f"\n== prefix cache: {args.prefix_len}-token shared prefix + 50 new tokens ==")
    print(f"prefill tokens computed: uncached {uncached_tokens}, cached {cached_tokens}  (target <= 64)")
    print(f"TTFT uncached {uncached_s * 1000:.0f} ms (after reset: {cold_s * 1000:.0f} ms), "
          f"cached {cached_s * 1000:.0f} ms, ratio {cached_s / uncached_s:.3f}  (target <= 0.05)")


def bench_overhead(args) -> None:
    llm = LLM(args.model, num_layers=args.num_layers, kv_cache_memory=args.kv_memory)
    engine = llm.engine
    model = engine.loaded.model
    forward_time = [0.0]
    original_forward = model.forward

    def timed_forward(*a, **k):
        t0 = time.process_time()
        out = original_forward(*a, **k)
        forward_time[0] += time.process_time() - t0
        return out

    model.forward = timed_forward
    print("\n== step overhead: CPU time per step outside the model forward ==")
    for batch in (1, 64):
        for i, p in enumerate(_prompts(batch, 16, 16, seed=batch)):
            engine.add_request(f"ovh-{batch}-{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
        engine.step()  # prefill
        forward_time[0] = 0.0
        steps = 20
        t0 = time.process_time()
        for _ in range(steps):
            engine.step()
        total = time.process_time() - t0
        print(f"{batch:3d} running: {(total - forward_time[0]) / steps * 1000:6.2f} ms/step outside "
              f"forward, {forward_time[0] / steps * 1000:7.2f} ms/step in forward")
        for i in range(batch):
            engine.abort_request(f"ovh-{batch}-{i}")
    model.forward = original_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=4000)
    parser.add_argument("--kv-memory", type=int, default=3 << 30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small sizes, 4 layers: a smoke run")
    parser.add_argument("--only", default="throughput,prefix,overhead")
    args = parser.parse_args()
    if args.quick:
        args.num_layers, args.num_prompts, args.output_len, args.prefix_len = 4, 8, 16, 500
    torch.set_num_threads(args.threads)
    which = set(args.only.split(","))
    if "throughput" in which or "kv" in which:
        bench_throughput(args)
    if "prefix" in which:
        bench_prefix(args)
    if "overhead" in which:
        bench_overhead(args)


if __name__ == "__main__":
    main()
