"""Weights-lifecycle benchmark (docs/benchmarks/engine.md). Prints numbers; asserts nothing.

  python benchmarks/lifecycle_bench.py [--kv-cache-memory 1GiB] [--dtype auto]
  python benchmarks/lifecycle_bench.py --fleet [--prefill 1 --decode 2]

One engine: sleep and wake latency per level, the memory they free, and update_weights time
for the full model. `--fleet`: the same calls through a `pdserve up` cluster's admin endpoints
(every worker of both pools; each call answers when all have applied it).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import LLM, SamplingParams
from engine.config import parse_size


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / (1 << 20)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fleet(prefill: int, decode: int, kv_cache_memory: int) -> None:
    import tempfile
    from pathlib import Path

    import httpx

    from engine.models.prepare import default_model_dir
    from local_cluster.launcher import UpProcess

    with tempfile.TemporaryDirectory() as home:
        up = UpProcess(
            Path(home),
            "--prefill",
            str(prefill),
            "--decode",
            str(decode),
            "--enable-sleep-mode",
            f"--worker-arg=--kv-cache-memory={kv_cache_memory}",
        )
        try:
            client = httpx.Client(base_url=up.url, timeout=600)
            body = {
                "model": "SmolLM2-135M-Instruct",
                "prompt": "Hello, my name is",
                "max_tokens": 16,
                "temperature": 0,
            }
            first = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            print(
                f"fleet: {prefill} prefill + {decode} decode workers, KV pool "
                f"{kv_cache_memory / (1 << 20):.0f} MiB each"
            )
            for call, params in (
                ("/sleep", {"level": 1}),
                ("/wake_up", None),
                ("/sleep", {"level": 2}),
                ("/wake_up", None),
            ):
                t0 = time.perf_counter()
                r = client.post(call, params=params)
                print(
                    f"{call}{'?level=' + str(params['level']) if params else '':9s} "
                    f"{(time.perf_counter() - t0) * 1000:8.1f} ms  (HTTP {r.status_code})"
                )
            path = str(default_model_dir() / "model.safetensors")
            t0 = time.perf_counter()
            r = client.post("/update_weights", json={"path": path})
            print(
                f"/update_weights  {(time.perf_counter() - t0) * 1000:8.1f} ms  (HTTP "
                f"{r.status_code})"
            )
            again = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            print(
                "output unchanged after sleep/wake and reloading the same weights: "
                f"{again == first}"
            )
        finally:
            up.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", type=parse_size, default=1 << 30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fleet", action="store_true")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    args = parser.parse_args(argv)
    if args.fleet:
        fleet(args.prefill, args.decode, args.kv_cache_memory)
        return
    torch.set_num_threads(args.threads)
    from engine.models.prepare import default_model_dir

    llm = LLM(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, enable_sleep_mode=True)
    engine = llm.engine
    engine.kv_cache.fill_(0)  # every page resident, as after real use
    params = SamplingParams(temperature=0.0, max_tokens=16)
    reference = llm.generate("Hello, my name is", params, use_tqdm=False)[0].outputs[0].token_ids
    print(
        f"dtype {engine.dtype}, KV pool {args.kv_cache_memory / (1 << 20):.0f} MiB, "
        f"{args.threads} thread(s); RSS awake {_rss_mib():.0f} MiB"
    )
    for level in (1, 2):
        rss = _rss_mib()
        slept = _timed(lambda: llm.sleep(level))
        freed = rss - _rss_mib()
        woke = _timed(llm.wake_up)
        same = (
            llm.generate("Hello, my name is", params, use_tqdm=False)[0].outputs[0].token_ids
            == reference
        )
        print(
            f"sleep({level}) {slept * 1000:8.1f} ms, freed {freed:7.0f} MiB; wake_up "
            f"{woke * 1000:8.1f} ms"
            f"{' (weights reloaded from the checkpoint)' if level == 2 else ''}; output unchanged: "
            f"{same}"
        )
    from safetensors.torch import load_file

    weights = load_file(str(default_model_dir() / "model.safetensors"))
    n = sum(t.numel() for t in weights.values())
    took = _timed(lambda: llm.update_weights(weights.items()))
    print(
        f"update_weights: {len(weights)} tensors, {n / 1e6:.0f} M parameters in {took * 1000:.0f} "
        f"ms (weights version {engine.weights_version})"
    )
    took = _timed(lambda: llm.update_weights(str(default_model_dir() / "model.safetensors")))
    print(f"update_weights from a safetensors path: {took * 1000:.0f} ms")


if __name__ == "__main__":
    main()
