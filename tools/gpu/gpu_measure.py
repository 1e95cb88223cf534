"""The in-process measurements of tools/gpu/gpu_check: copy bandwidth, paged attention
(decode bandwidth, one prefill chunk's TFLOP/s), and the engine (offline throughput with each
attention backend, and the KV pool that `gpu_memory_utilization` gave it).

On CPU (`dry_run`) the same code runs on tiny shapes under the Triton interpreter."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

# SmolLM2-135M attention shapes.
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# (batch, context) decode cases; on GPU each reads ~200 MB of KV per call (bf16), several
# times the L2 cache, so the numbers are DRAM bandwidth.
GPU_DECODE_CASES = [(2, 131_072), (8, 32_768), (64, 2_048), (64, 4_096), (256, 1_024)]
DRY_DECODE_CASES = [(2, 96)]
# name -> plan_paged_attention keyword arguments. "auto" is what the engine gets; the others show
# what splitting (none, or fixed partition sizes) buys and whether the default launch options
# leave bandwidth on the table.
GPU_VARIANTS = {
    "auto": {},
    "no-split": {"partition_size": 0},
    "auto warps=4": {"num_warps": 4},
    "auto warps=8": {"num_warps": 8},
    "auto stages=2": {"num_stages": 2},
    "auto tile=32": {"tile_n": 32},
    "auto w8 t32": {"num_warps": 8, "tile_n": 32},
    "split=1024": {"partition_size": 1024},
    "split=512": {"partition_size": 512},
}
DRY_VARIANTS = {
    "split=32": {"partition_size": 32},
    "no-split": {"partition_size": 0},
    "split=32 w8": {"partition_size": 32, "num_warps": 8, "num_stages": 2},
}


@dataclass
class DecodeResult:
    batch: int
    context: int
    variant: str  # a key of GPU_VARIANTS / DRY_VARIANTS
    partitions: int
    ms: float
    kv_gbps: float  # bytes of K and V read per second / 1e9
    fraction_of_copy: float
    replayed_ms: float | None = None  # from a CUDA graph (Timer.replayed): the GPU's time alone
    replayed_fraction_of_copy: float | None = None


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

    def replayed(self, fn, iters: int = 20) -> float | None:
        """Mean milliseconds per call with `iters` calls captured in one CUDA graph and replayed:
        the GPU's time alone (the engine replays decode steps so); None off CUDA. Eager
        launches of a small kernel can cost the host more than the GPU spends on it."""
        if not self.cuda:
            return None
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
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
    kv_cache = torch.randn(
        num_blocks, NUM_KV_HEADS, num_layers, 2, BLOCK_SIZE, HEAD_DIM, dtype=dtype, device=device
    )
    block_tables = (
        torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    )
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
            plan = plan_paged_attention(
                device, batch, batch, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 1, context, **plan_kwargs
            )
            call = partial(
                paged_attention,
                query,
                kv_cache,
                0,
                tables,
                qsl,
                seq_lens,
                HEAD_DIM**-0.5,
                1,
                context,
                plan=plan,
            )
            outputs[name] = call()
            ms = timer(call)
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            replayed = timer.replayed(call)
            replayed_share = (
                None if replayed is None else kv_bytes / (replayed * 1e-3) / 1e9 / copy_gbps
            )
            results.append(
                DecodeResult(
                    batch,
                    context,
                    name,
                    plan.num_partitions,
                    round(ms, 4),
                    round(gbps, 1),
                    round(gbps / copy_gbps, 3),
                    replayed and round(replayed, 4),
                    replayed_share and round(replayed_share, 3),
                )
            )
            graph_text = (
                ""
                if replayed is None
                else f" | replayed {replayed:7.3f} ms = {replayed_share:6.1%}"
            )
            print(
                f"  decode batch={batch:4d} ctx={context:6d} {name:12s} "
                f"partitions={plan.num_partitions:3d} "
                f"{ms:9.3f} ms  KV read {gbps:8.1f} GB/s  = {gbps / copy_gbps:6.1%} of "
                f"copy{graph_text}",
                flush=True,
            )
        first, *others = outputs.values()
        for other in others:
            torch.testing.assert_close(other, first, atol=2e-2, rtol=2e-2)
        if batch * context <= 8_192:  # the per-sequence reference is only cheap for small cases
            ref = paged_attention_reference(
                query, kv_cache, 0, tables, qsl, seq_lens, HEAD_DIM**-0.5
            )
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
    ms = timer(
        lambda: paged_attention(
            query, kv_cache, 0, tables, qsl, seq_lens, HEAD_DIM**-0.5, q_len, total
        )
    )
    # QK^T and PV over the causal region: 2 matmuls x 2 flops x keys seen per query.
    keys_seen = q_len * cached + q_len * (q_len + 1) / 2
    tflops = 4 * NUM_Q_HEADS * HEAD_DIM * keys_seen / (ms * 1e-3) / 1e12
    print(
        f"  prefill chunk q_len={q_len} on {cached} cached: {ms:.3f} ms  {tflops:.1f} TFLOP/s",
        flush=True,
    )
    return {"q_len": q_len, "cached": cached, "ms": round(ms, 4), "tflops": round(tflops, 2)}


def engine_throughput(model: Path, device, dry_run: bool) -> dict:
    """Offline generation with each attention backend (the model dtype: bf16 on GPU): tokens/s,
    the KV pool `gpu_memory_utilization` gave, and how far the two backends' greedy tokens
    agree (bf16 kernels round differently, so long greedy runs may part; the fp32 parity is
    tests/engine/test_gpu_engine.py's)."""
    results: dict = {}
    tokens = {}
    # "triton": the default (CUDA graphs for decode steps); "triton_eager": enforce_eager.
    for name, backend, eager in (
        ("triton", "triton", False),
        ("triton_eager", "triton", True),
        ("torch", "torch", False),
    ):
        results[name], tokens[name] = _generate(model, backend, device, dry_run, eager)
        print(f"  engine {name:12s}: {results[name]}", flush=True)
    results["speedup"] = round(
        results["triton"]["tokens_per_s"] / results["torch"]["tokens_per_s"], 2
    )
    results["graph_speedup"] = {
        key: round(results["triton"][key] / results["triton_eager"][key], 2)
        for key in ("tokens_per_s", "small_batch_tokens_per_s")
    }
    results["greedy_agreement"] = _agreement(tokens["triton"], tokens["torch"])
    results["graph_vs_eager_agreement"] = _agreement(tokens["triton"], tokens["triton_eager"])
    return results


def _agreement(a_runs: list[list[int]], b_runs: list[list[int]]) -> dict:
    """How far two runs' greedy completions of the same prompts agree."""
    pairs = list(zip(a_runs, b_runs))
    return {
        "identical_completions": sum(a == b for a, b in pairs) / len(pairs),
        "mean_common_prefix": sum(_common_prefix(a, b) for a, b in pairs) / len(pairs),
        "first_token_equal": sum(a[:1] == b[:1] for a, b in pairs) / len(pairs),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _generate(
    model: Path, backend: str, device, dry_run: bool, enforce_eager: bool = False
) -> tuple[dict, list[list[int]]]:
    """The big batch (tokens and speed) and a small one (8 prompts: launch-bound decode
    steps, where CUDA graphs matter most)."""
    import torch

    import engine

    num_prompts, max_tokens = (1, 2) if dry_run else (128, 128)
    utilization = 0.45  # engines live one after the other in this process
    llm = engine.LLM(
        str(model),
        attention_backend=backend,
        device=device.type,
        gpu_memory_utilization=utilization,
        enforce_eager=enforce_eager,
        # Dry run: a 2-layer model and a small pool keep the interpreter quick.
        **({"num_layers": 2, "kv_cache_memory": 64 << 20} if dry_run else {}),
    )
    pool = llm.engine.kv_cache
    kv_pool = {
        "num_blocks": pool.shape[0],
        "block_size": pool.shape[3],
        "pool_gib": round(pool.numel() * pool.element_size() / 2**30, 3),
    }
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        kv_pool.update(
            gpu_memory_utilization=utilization,
            allocated_fraction=round(torch.cuda.memory_allocated(device) / total, 4),
            tokens=pool.shape[0] * pool.shape[3],
        )
    token_ids, seconds = _timed_greedy(llm, num_prompts, max_tokens, device)
    generated = sum(len(t) for t in token_ids)
    small_ids, small_seconds = _timed_greedy(llm, 2 if dry_run else 8, max_tokens, device)
    graphs = llm.engine.runner.graphs
    graph_info = (
        None if graphs is None else {"captured": graphs.captured, "disabled": graphs.disabled}
    )
    del llm, pool, graphs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return (
        {
            "prompts": num_prompts,
            "max_tokens": max_tokens,
            "generated_tokens": generated,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(generated / seconds, 1),
            "small_batch_tokens_per_s": round(sum(map(len, small_ids)) / small_seconds, 1),
            "cuda_graphs": graph_info,
            "kv_pool": kv_pool,
        },
        token_ids,
    )


def _timed_greedy(llm, num_prompts: int, max_tokens: int, device) -> tuple[list[list[int]], float]:
    """(each prompt's greedy token ids, seconds) of one timed batch, after a warm-up on the same
    batch, shorter: it compiles the kernel variants this batch shape needs (prefill tiles, mixed
    steps, decode) outside the timed run."""
    import torch

    import engine

    params = engine.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [f"Write a short story about the number {i}." for i in range(num_prompts)]
    warm = engine.SamplingParams(max_tokens=min(8, max_tokens), temperature=0.0, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start


def tp_parity(model: Path, device, dry_run: bool) -> dict:
    """Tensor parallelism (docs/parallelism.md): the same greedy batch at
    tensor_parallel_size 1 and 2 — tokens/s of each, their ratio, and how far the tokens agree
    (bf16 all-reduces sum in another order than one device's GEMMs, so long greedy runs may part
    at near-ties; the fp32 parity is tests/parallel's). On CUDA it needs 2 GPUs (rank r on
    cuda:r, NCCL); the dry run takes 2 CPU processes over gloo."""
    import torch

    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"}
    results: dict = {}
    tokens = {}
    for size in (1, 2):
        results[f"tp{size}"], tokens[size] = _generate_tp(model, size, device, dry_run)
        print(f"  tensor_parallel_size {size}: {results[f'tp{size}']}", flush=True)
    results["tp2_over_tp1"] = round(
        results["tp2"]["tokens_per_s"] / results["tp1"]["tokens_per_s"], 2
    )
    results["greedy_agreement"] = _agreement(tokens[1], tokens[2])
    return results


def _generate_tp(model: Path, size: int, device, dry_run: bool) -> tuple[dict, list[list[int]]]:
    import engine

    num_prompts, max_tokens = (2, 4) if dry_run else (64, 128)
    llm = engine.LLM(
        str(model),
        device=device.type,
        tensor_parallel_size=size,
        # With tensor_parallel_size > 1 on CUDA the KV budget must be explicit.
        kv_cache_memory=(64 << 20) if dry_run else (8 << 30),
        **({"num_layers": 2, "dtype": "float32", "attention_backend": "torch"} if dry_run else {}),
    )
    try:
        token_ids, seconds = _timed_greedy(llm, num_prompts, max_tokens, device)
    finally:
        llm.close()
    generated = sum(len(t) for t in token_ids)
    return {
        "prompts": num_prompts,
        "generated_tokens": generated,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(generated / seconds, 1),
    }, token_ids
