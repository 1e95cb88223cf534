"""Time to first token through the split path (1 prefill + 1 decode worker, the prompt always
prefilled remotely) against one colocated worker, with the prompt computed on ONE core in both
(`--num-threads 1`), for prompts of several lengths — issue 58's target: the split costs
nothing beyond moving the bytes, TTFT(1P+1D) <= TTFT(colocated) + raw transfer + 10 ms.

  python benchmarks/split_ttft.py [--lengths 256,2048,8000] [--repeats 3] [--cores 0,1]
      [--max-model-len N] [--num-layers N]

Each configuration is one `pdserve up` serving the bundled model; requests are sequential,
streamed /v1/completions with token-id prompts that share no prefix (no cache hits), and
TTFT is the client's time to the first streamed token. The colocated run goes first, then
the split one; every length is measured in both. "raw copy" is a memcpy of the prompt's KV
bytes in this process (what the transfer could cost at best on this host). 32k-token prompts
need `--max-model-len 33000` (beyond the bundled model's trained length: a speed test only).

Before the fix that added progress windows to KV transfers (issue 58), the 8k-token prompt
took 2x colocated here: the prefill worker's fixed write deadline failed the transfer while
chunks were still computing, and the decode worker prefilled the prompt again itself.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from bench_cluster import add_pinned_args, pinned_worker_flags, start_pinned, stop_pinned

from engine.runner.device import cpu_has_native_bf16


def start_up(split: bool, cores: str, work: Path, flags: list[str]) -> tuple[subprocess.Popen, str]:
    """`pdserve up` pinned to `cores`, workers on one thread, `flags` for every worker; returns
    (process, router URL). Split: every prompt goes to the prefill worker (no local prefill
    on estimates)."""
    return start_pinned(
        "split" if split else "colocated",
        cores,
        work,
        split=split,
        up_args=[
            *(["--router-arg=--local-prefill-max-tokens=0"] if split else []),
            *[f"--worker-arg={f}" for f in flags],
        ],
        # Past the model's trained length (32k prompts): served for speed, as vLLM's switch allows.
        env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
    )


def ttft_s(client: httpx.Client, url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending the request to its first streamed token."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:300]}")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text") is not None:
                    return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def kv_bytes_per_token(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    element = 2 if cpu_has_native_bf16() else 4  # dtype auto on this CPU
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * element


def raw_copy_s(nbytes: int, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="256,2048,8000", help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=3, help="requests per length (median)")
    add_pinned_args(parser)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    flags = pinned_worker_flags(args, "3GiB")
    if args.max_model_len:
        flags.append(f"--max-model-len={args.max_model_len}")
    model_dir = subprocess.run(
        [sys.executable, "-m", "pdserve", "prepare-model"], capture_output=True, text=True,
        check=True,
    ).stdout.strip()  # fmt: skip
    per_token = kv_bytes_per_token(model_dir)
    work = Path(tempfile.mkdtemp(prefix="pdserve-split-ttft-"))
    ttfts: dict[tuple[bool, int], list[float]] = {}
    for split in (False, True):
        proc, url = start_up(split, args.cores, work, flags)
        try:
            with httpx.Client(timeout=args.timeout) as client:
                model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
                rng = random.Random(7)  # the same prompts in both configurations
                ttft_s(client, url, model, [rng.randrange(100, 40000) for _ in range(64)])  # warm
                for n in lengths:
                    ttfts[split, n] = [
                        ttft_s(client, url, model, [rng.randrange(100, 40000) for _ in range(n)])
                        for _ in range(args.repeats)
                    ]
                    print(f"{'1P+1D' if split else 'colocated'} {n}: {ttfts[split, n]}", flush=True)
        finally:
            stop_pinned(proc)
    print(f"\nTTFT, median of {args.repeats}, prompt computed on one core, logs in {work}")
    print(
        f"{'prompt':>8} {'colocated':>11} {'1P+1D':>11} {'ratio':>7} {'extra':>10} {'raw copy':>9}"
    )
    for n in lengths:
        colo, split = (statistics.median(ttfts[s, n]) for s in (False, True))
        copy_s = raw_copy_s(n * per_token)
        print(
            f"{n:>8} {colo * 1e3:>9.0f}ms {split * 1e3:>9.0f}ms {split / colo:>6.2f}x "
            f"{(split - colo) * 1e3:>+8.0f}ms {copy_s * 1e3:>7.1f}ms"
        )


if __name__ == "__main__":
    main()
