"""One-command GPU check of the Triton kernels (run through benchmarks/gpu_check.sh).

Steps, each printed as it finishes and collected into a JSON report:
1. `pytest -m gpu tests/kernels`: the kernels against their torch references at realistic sizes.
2. Device-to-device copy bandwidth (a torch copy of a large tensor): the practical memory roof.
3. Decode attention (SmolLM2-135M shapes, one layer): bytes of KV read per second, with the
   automatic split-KV choice, with splitting off and with a few launch-option variants, as a
   fraction of the copy bandwidth; plus one prefill chunk's TFLOP/s for orientation.
4. Engine offline throughput (128 prompts x 128 greedy tokens, default model) with the Triton vs
   the torch attention backend, through `engine.LLM(attention_backend=...)` if the engine takes
   it (directly or via **engine_args into EngineConfig); otherwise a TODO is reported.

--dry-run runs the same code on CPU under the Triton interpreter with tiny shapes (a test runs
it), so the script is known to work before it meets a GPU. Needs no network; the whole GPU run
is sized to finish well inside 5 minutes.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# SmolLM2-135M attention shapes.
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# (batch, context) decode cases; on GPU each reads ~200 MB of KV per call (bf16), several
# times the L2 cache, so the numbers are DRAM bandwidth.
GPU_DECODE_CASES = [(2, 131_072), (8, 32_768), (64, 4_096), (256, 1_024)]
DRY_DECODE_CASES = [(2, 96)]
# name -> plan_paged_attention keyword arguments. "auto" is what the engine gets; the others show
# what splitting buys and whether the default launch options leave bandwidth on the table.
GPU_VARIANTS = {
    "auto": {},
    "no-split": {"partition_size": 0},
    "auto warps=8": {"num_warps": 8},
    "auto stages=2": {"num_stages": 2},
    "auto tile=32": {"tile_n": 32},
    "auto w8 t32": {"num_warps": 8, "tile_n": 32},
}
DRY_VARIANTS = {"split=32": {"partition_size": 32}, "no-split": {"partition_size": 0},
                "split=32 w8": {"partition_size": 32, "num_warps": 8, "num_stages": 2}}


@dataclass
class DecodeResult:
    batch: int
    context: int
    variant: str  # a key of GPU_VARIANTS / DRY_VARIANTS
    partitions: int
    ms: float
    kv_gbps: float  # bytes of K and V read per second / 1e9
    fraction_of_copy: float


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU + Triton interpreter, tiny shapes (checks the script itself)")
    p.add_argument("--skip-pytest", action="store_true", help="skip step 1")
    p.add_argument("--skip-engine", action="store_true", help="skip step 4")
    p.add_argument("--budget-s", type=float, default=270,
                   help="wall-clock budget: the pytest timeout shrinks and the engine step is skipped to fit")
    p.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "gpu_check.json",
                   help="where to write the report")
    return p.parse_args(argv)


def run_pytest(timeout: int) -> dict:
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        code, lines = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        code, lines = f"timeout after {timeout} s", out.strip().splitlines()
    # returncode 5 would mean nothing was selected; on CPU every gpu test is skipped (0).
    return {"command": " ".join(cmd), "returncode": code, "summary": lines[-1] if lines else "",
            "seconds": round(time.perf_counter() - start, 1), "output_tail": "\n".join(lines[-40:])}


class Timer:
    """Mean milliseconds per call: CUDA events on GPU, wall clock (one call) on CPU."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def __call__(self, fn, warmup: int = 3, iters: int = 20) -> float:
        if not self.cuda:
            fn()  # compile / first-call work stays out of the timing, as on GPU
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        torch = self.torch
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters


def copy_bandwidth(device, timer, dry_run: bool) -> float:
    """GB/s of a device-to-device copy, counting bytes read + written."""
    import torch

    nbytes = (8 << 20) if dry_run else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_decode_batch(batch: int, context: int, dtype, device, num_layers: int = 1):
    """A random pool holding `batch` sequences of `context` tokens in shuffled blocks, and one
    query token per sequence (the last position)."""
    import torch

    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(num_blocks, num_layers, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                           dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=dtype, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return query, kv_cache, block_tables, query_start_loc, seq_lens


def decode_bandwidth(device, dtype, timer, copy_gbps: float, dry_run: bool) -> list[DecodeResult]:
    import torch

    from kernels import paged_attention, paged_attention_reference, plan_paged_attention

    variants = DRY_VARIANTS if dry_run else GPU_VARIANTS
    results = []
    for batch, context in DRY_DECODE_CASES if dry_run else GPU_DECODE_CASES:
        query, kv_cache, tables, qsl, seq_lens = make_decode_batch(batch, context, dtype, device)
        kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * kv_cache.element_size()
        outputs = {}
        for name, plan_kwargs in variants.items():
            plan = plan_paged_attention(device, batch, batch, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 1,
                                        context, **plan_kwargs)

            def call(plan=plan):
                return paged_attention(query, kv_cache, 0, tables, qsl, seq_lens, HEAD_DIM ** -0.5,
                                       1, context, plan=plan)

            outputs[name] = call()
            ms = timer(call)
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            results.append(DecodeResult(batch, context, name, plan.num_partitions, round(ms, 4),
                                        round(gbps, 1), round(gbps / copy_gbps, 3)))
            print(f"  decode batch={batch:4d} ctx={context:6d} {name:12s} partitions={plan.num_partitions:3d} "
                  f"{ms:9.3f} ms  KV read {gbps:8.1f} GB/s  = {gbps / copy_gbps:6.1%} of copy", flush=True)
        first, *others = outputs.values()
        for other in others:
            torch.testing.assert_close(other, first, atol=2e-2, rtol=2e-2)
        if batch * context <= 8_192:  # the per-sequence reference is only cheap for small cases
            ref = paged_attention_reference(query, kv_cache, 0, tables, qsl, seq_lens, HEAD_DIM ** -0.5)
            torch.testing.assert_close(first, ref, atol=2e-2, rtol=2e-2)
        del query, kv_cache, tables, outputs
    return results


def prefill_tflops(device, dtype, timer, dry_run: bool) -> dict:
    """One chunk of q_len new tokens on top of `cached` cached tokens, one sequence."""
    import torch

    from kernels import paged_attention

    cached, q_len = (32, 32) if dry_run else (4_096, 4_096)
    total = cached + q_len
    _, kv_cache, tables, _, _ = make_decode_batch(1, total, dtype, device)
    query = torch.randn(q_len, NUM_Q_HEADS, HEAD_DIM, dtype=dtype, device=device)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
    ms = timer(lambda: paged_attention(query, kv_cache, 0, tables, qsl, seq_lens, HEAD_DIM ** -0.5,
                                       q_len, total))
    # QK^T and PV over the causal region: 2 matmuls x 2 flops x keys seen per query.
    keys_seen = q_len * cached + q_len * (q_len + 1) / 2
    tflops = 4 * NUM_Q_HEADS * HEAD_DIM * keys_seen / (ms * 1e-3) / 1e12
    print(f"  prefill chunk q_len={q_len} on {cached} cached: {ms:.3f} ms  {tflops:.1f} TFLOP/s", flush=True)
    return {"q_len": q_len, "cached": cached, "ms": round(ms, 4), "tflops": round(tflops, 2)}


def _accepts(engine, name: str) -> bool:
    """Does engine.LLM take keyword `name` (directly, or through **engine_args into EngineConfig)?"""
    params = inspect.signature(engine.LLM).parameters
    if name in params:
        return True
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    config = getattr(engine, "EngineConfig", None)
    return takes_kwargs and config is not None and name in getattr(config, "__dataclass_fields__", {})


def engine_throughput(device, dry_run: bool) -> dict:
    """Offline generation throughput with each attention backend."""
    try:
        import engine
    except ImportError as exc:  # pragma: no cover - the package is part of the repo
        return {"skipped": f"engine not importable: {exc}"}
    if getattr(engine, "LLM", None) is None or not _accepts(engine, "attention_backend"):
        # TODO(engine): expose `engine.LLM(model=..., attention_backend="triton" | "torch")` and
        # `engine.SamplingParams`; this step then measures them with no change here.
        return {"skipped": "TODO(engine): engine.LLM with an attention_backend argument is not there yet"}
    results = {}
    for backend in ("triton", "torch"):
        results[backend] = _generate_tokens_per_s(engine, backend, device, dry_run)
        print(f"  engine {backend:6s}: {results[backend]}", flush=True)
    results["speedup"] = round(results["triton"]["tokens_per_s"] / results["torch"]["tokens_per_s"], 2)
    return results


def _generate_tokens_per_s(engine, backend: str, device, dry_run: bool) -> dict:
    import gc

    import torch

    num_prompts, max_tokens = (1, 2) if dry_run else (128, 128)
    wanted = {"attention_backend": backend, "device": device.type,
              # Two engines live one after the other in this process: leave room for both.
              "gpu_memory_utilization": 0.45,
              # Dry run: a 2-layer model and a small pool keep the interpreter quick.
              **({"num_layers": 2, "kv_cache_memory": 64 << 20} if dry_run else {})}
    llm = engine.LLM(**{k: v for k, v in wanted.items() if _accepts(engine, k)})
    params = engine.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    quiet = {"use_tqdm": False} if "use_tqdm" in inspect.signature(llm.generate).parameters else {}
    prompts = [f"Write a short story about the number {i}." for i in range(num_prompts)]
    # Warm-up on the same batch, shorter: compiles the kernel variants this batch shape needs
    # (prefill tiles, mixed steps, decode) outside the timed run.
    warm = engine.SamplingParams(max_tokens=min(8, max_tokens), temperature=0.0, ignore_eos=True)
    llm.generate(prompts, warm, **quiet)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, **quiet)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm, outputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"prompts": num_prompts, "max_tokens": max_tokens, "generated_tokens": generated,
            "seconds": round(seconds, 3), "tokens_per_s": round(generated / seconds, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton/kernels are imported
    sys.path.insert(0, str(REPO))
    import torch

    if args.dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (use --dry-run to check the script on CPU)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    dtype = torch.bfloat16 if device.type == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
                    "torch": torch.__version__, "dtype": str(dtype)}
    import triton

    report["triton"] = triton.__version__
    print(f"gpu_check on {report['device']}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    deadline = time.monotonic() + args.budget_s
    failed = False

    def step(key: str, fn) -> None:
        """Run one step into report[key]; an error is recorded, not fatal; save after each."""
        nonlocal failed
        try:
            report[key] = fn()
        except Exception as exc:  # keep the other steps' numbers
            traceback.print_exc()
            report[key] = {"error": f"{type(exc).__name__}: {exc}"}
            failed = True
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))

    if args.skip_pytest:
        report["pytest"] = {"skipped": "--skip-pytest"}
    else:
        print("[1/4] pytest -m gpu tests/kernels", flush=True)
        timeout = 60 if args.dry_run else max(30, min(180, int(deadline - time.monotonic()) - 90))
        step("pytest", lambda: run_pytest(timeout))
        res = report["pytest"]
        print(f"  rc={res.get('returncode')} {res.get('summary', '')} ({res.get('seconds')} s)", flush=True)
        if res.get("returncode") not in (0, 5):
            failed = True
            print(res.get("output_tail", ""), flush=True)

    timer = Timer(device)
    print("[2/4] device-to-device copy bandwidth", flush=True)
    step("copy_gbps", lambda: round(copy_bandwidth(device, timer, args.dry_run), 1))
    copy_gbps = report["copy_gbps"] if isinstance(report["copy_gbps"], float) else float("nan")
    print(f"  copy: {copy_gbps:.1f} GB/s (read + write)", flush=True)

    print(f"[3/4] paged attention, SmolLM2-135M shapes ({dtype})", flush=True)
    step("decode", lambda: [asdict(r) for r in decode_bandwidth(device, dtype, timer, copy_gbps, args.dry_run)])
    step("prefill", lambda: prefill_tflops(device, dtype, timer, args.dry_run))

    print("[4/4] engine offline throughput, triton vs torch attention", flush=True)
    if args.skip_engine:
        step("engine", lambda: {"skipped": "--skip-engine"})
    elif deadline - time.monotonic() < 60:
        step("engine", lambda: {"skipped": "time budget spent"})
    else:
        step("engine", lambda: engine_throughput(device, args.dry_run))
    print(f"  {report['engine']}", flush=True)
    print(f"report: {args.json}  {'FAILED' if failed else 'OK'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
