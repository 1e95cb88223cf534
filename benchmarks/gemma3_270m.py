"""Gemma 3 270M (bundled `gemma-3-270m`) end to end, offline: `engine.LLM` against transformers
on the same prepared directory. Prints numbers and ratios measured in one run; asserts nothing.

    python benchmarks/gemma3_270m.py                 # float32 (+ bf16 with AVX512-BF16), ~2.5 min
    python benchmarks/gemma3_270m.py --dtypes float32 --decode-tokens 16

- TTFT: one --prompt-len-token prompt (random ids), max 1 new token, wall time of the call;
  median of --ttft-reps, a fresh prompt each rep (no prefix-cache hit), the sides interleaved.
- decode: 1 and 8 sequences of --prompt-len-token prompts, --decode-tokens greedy tokens each,
  ignore_eos; tok/s = tokens produced after the last sequence's first token / time from then
  to the end (prefill excluded), best of --decode-reps, the sides interleaved. Ours: the
  engine stepped directly (as spec_decode_bench); HF: one static batch through `generate`
  (no padding: equal lengths), the first token's time taken from a streamer.
- sliding-window KV memory, COMPUTED from the model's parsed layer types and window: the KV
  that one --memory-seq-len-token sequence holds without release (every layer keeps every
  block) against the engine's per-KV-group release (benchmarks/window_memory.py measures it
  on tiny checkpoints).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from arch_throughput import cpu_has_bf16

from engine import LLM, SamplingParams
from engine.kv.kv_pool import kv_block_bytes
from engine.models.prepare import resolve_model_path

MODEL = "gemma-3-270m"


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 200_000) for _ in range(length)] for _ in range(n)]


def ours_ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_ttft(hf, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    hf.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)
    return time.perf_counter() - t0


def ours_decode(llm: LLM, prompts: list[list[int]], max_tokens: int, tag: str) -> float:
    """Decode tok/s: after every sequence has its first token, to the end."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    counts = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
        counts[f"{tag}-{i}"] = 0
    t_first = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            counts[delta.request_id] += len(delta.token_ids)
        if t_first is None and all(counts.values()):
            t_first, at_first = time.perf_counter(), sum(counts.values())
    return (sum(counts.values()) - at_first) / (time.perf_counter() - t_first)


@torch.inference_mode()
def hf_decode(hf, prompts: list[list[int]], max_tokens: int) -> float:
    """Decode tok/s of one static batch: `put` is called with the prompt, then each step's
    tokens."""
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        calls, t_first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.t_first = time.perf_counter()

        def end(self):
            pass

    streamer = FirstToken()
    hf.generate(
        torch.tensor(prompts),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        streamer=streamer,
    )
    return len(prompts) * (max_tokens - 1) / (time.perf_counter() - streamer.t_first)


def window_memory(llm: LLM, seq_len: int) -> None:
    """Computed: KV of one seq_len-token sequence with and without per-layer window release."""
    args, block = llm.engine.loaded.args, llm.engine.config.block_size
    windows = [args.window(i) for i in range(args.n_layers)]
    blocks = -(-seq_len // block)
    # one layer's share of a block, bf16 / fp32
    layer_bytes = [
        kv_block_bytes(args, block, d) // args.n_layers for d in (torch.bfloat16, torch.float32)
    ]
    today = args.n_layers * blocks
    sliding = [w for w in windows if w is not None]
    n_global = args.n_layers - len(sliding)
    # A sliding layer needs the blocks under its last W tokens: ceil(W / B) when the window
    # starts on a block boundary (as at seq_len = 8,192), one more when it straddles one.
    aligned = n_global * blocks + sum(min(blocks, -(-w // block)) for w in sliding)
    upper = n_global * blocks + sum(min(blocks, -(-w // block) + 1) for w in sliding)

    def mib(n: int) -> str:
        return " / ".join(f"{n * b / 2**20:.1f}" for b in layer_bytes) + " MiB (bf16 / fp32)"

    print(
        f"\n== sliding-window KV memory, COMPUTED (not measured): one {seq_len}-token sequence, "
        f"block size {block} =="
    )
    print(
        f"layers {args.n_layers}: {len(sliding)} sliding (window {sorted(set(sliding))}), "
        f"{n_global} global; "
        f"one layer's share of a block {layer_bytes[0]} / {layer_bytes[1]} bytes (bf16 / fp32)"
    )
    print(
        f"without window release: {blocks} blocks x {args.n_layers} layers = {today} layer-blocks, "
        f"{mib(today)}"
    )
    print(
        f"with window release (the engine's KV groups): {n_global} x {blocks} + {len(sliding)} "
        "sliding layers x "
        f"{-(-sliding[0] // block) if sliding else 0}-"
        f"{-(-sliding[0] // block) + 1 if sliding else 0} "
        f"= {aligned}-{upper} layer-blocks, {mib(upper)} at the upper bound"
    )
    print(
        f"ratio without / with release: {today / upper:.2f}x (upper bound) - "
        f"{today / aligned:.2f}x (aligned); "
        f"release keeps {upper / today:.1%} of the KV"
    )


def bench(dtype: str, args) -> None:
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    llm = LLM(MODEL, dtype=dtype, kv_cache_memory=512 << 20)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL), dtype=torch_dtype).eval()
    print(
        f"\n== {MODEL} {dtype}: ours vs transformers (HF attention: "
        f"{hf.config._attn_implementation}) =="
    )
    warm = make_prompts(1, 16, seed=99)
    ours_ttft(llm, warm[0])
    hf_ttft(hf, warm[0])
    ours_t, hf_t = [], []
    for prompt in make_prompts(args.ttft_reps, args.prompt_len, seed=1):  # fresh: no prefix hit
        ours_t.append(ours_ttft(llm, prompt))
        hf_t.append(hf_ttft(hf, prompt))
    ours_med, hf_med = statistics.median(ours_t), statistics.median(hf_t)
    print(
        f"TTFT, {args.prompt_len}-token prompt, median of {args.ttft_reps}: ours "
        f"{ours_med * 1e3:.0f} ms, "
        f"HF {hf_med * 1e3:.0f} ms, ours/HF {ours_med / hf_med:.2f} (lower is better)"
    )
    for batch in (1, 8):
        batch_prompts = make_prompts(batch, args.prompt_len, seed=10 + batch)
        ours = theirs = 0.0
        for rep in range(args.decode_reps):  # interleaved: a busy stretch hits both sides
            ours = max(ours, ours_decode(llm, batch_prompts, args.decode_tokens, f"d{batch}-{rep}"))
            theirs = max(theirs, hf_decode(hf, batch_prompts, args.decode_tokens))
        print(
            f"decode x{batch}, best of {args.decode_reps}: ours {ours:.1f} tok/s, HF {theirs:.1f} "
            f"tok/s, ratio {ours / theirs:.2f}x"
        )
    if dtype == args.dtypes[0]:
        window_memory(llm, args.memory_seq_len)
    del llm, hf


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dtypes",
        default="auto",
        help="comma-separated; auto = float32, and bfloat16 if the CPU has AVX512-BF16/AMX",
    )
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--ttft-reps", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--decode-reps", type=int, default=2)
    parser.add_argument("--memory-seq-len", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    args.dtypes = (
        (["float32", "bfloat16"] if cpu_has_bf16() else ["float32"])
        if args.dtypes == "auto"
        else args.dtypes.split(",")
    )
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} "
        f"thread(s), AVX512-BF16/AMX: {cpu_has_bf16()}"
    )
    start = time.perf_counter()
    for dtype in args.dtypes:
        bench(dtype, args)
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
