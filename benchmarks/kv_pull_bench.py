"""Peer pull (docs/kv_pull.md) measured between two real worker processes on loopback (NIXL
over UCX, real etcd): a holder computed a long prompt; the other worker receives the same
prompt with `kv_source` naming the holder and pulls its blocks instead of computing them.

  python benchmarks/kv_pull_bench.py [--lengths 512,2048] [--repeats 3] [--num-layers N]

Per prompt length, in the same run:
- TTFT with the pull vs TTFT computing the prompt (the puller's prefix cache reset between
  runs, so each run pulls or computes the whole prompt): the reuse a pull buys;
- pull throughput (the puller's pdserve_worker_kv_pull_seconds: SendBlocks call to the blocks
  joining its prefix cache, round trip included) vs a memcpy of the same bytes in this process;
- NIXL descriptors per pull (the holder's vllm:nixl_num_descriptors): one per run of blocks
  adjacent in both pools. benchmarks/kv_tp_transfer.py has the transfer alone (no gRPC, no
  engine steps), from fresh and fragmented pools.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from cluster.etcd_server import EtcdServer
from cluster.grpc_auth import aio_channel
from cluster.grpc_security import OPEN
from cluster.net import free_port
from local_cluster.launcher import ServiceProcess
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="default")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def _metric(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


async def _ttft(worker: ServiceProcess, prompt: list[int], source: ServiceProcess | None) -> float:
    req = pb.GenerateRequest(
        request_id=f"pull-bench-{random.getrandbits(48)}",
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=1),
    )
    if source is not None:
        req.kv_source.CopyFrom(
            pb.KVSource(
                worker_id=source.worker_id,
                address=source.grpc_address,
                num_blocks=(len(prompt) - 1) // BLOCK,
            )
        )
    async with aio_channel(worker.grpc_address, OPEN) as ch:
        t0 = time.perf_counter()
        async for _ in pb_grpc.DecodeWorkerStub(ch).Generate(req, timeout=600):
            return time.perf_counter() - t0
    raise RuntimeError("no response")


async def _reset(worker: ServiceProcess) -> None:
    async with aio_channel(worker.grpc_address, OPEN) as ch:
        await pb_grpc.WorkerStub(ch).ResetPrefixCache(pb.LifecycleRequest(), timeout=60)


def _memcpy_gbps(num_bytes: int, repeats: int = 5) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return num_bytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    flags = [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--num-threads",
        "1",
        "--enable-admin-rpcs",
    ]
    if args.num_layers:
        flags += ["--num-layers", str(args.num_layers)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-pull-bench-") as tmp, EtcdServer() as etcd:
        workers = [
            ServiceProcess(
                ["decode", "--etcd", etcd.endpoint, "--port", str(free_port()), *flags],
                Path(tmp) / f"w{i}.log",
            )
            for i in range(2)
        ]
        try:
            holder, puller = (w.wait_ready(300) for w in workers)
            time.sleep(2.0)  # each adds the other as a KV peer (warm-up runs every second)
            rng = random.Random(0)
            for n in lengths:
                prompt = [rng.randrange(100, 30000) for _ in range(n)]
                asyncio.run(_ttft(holder, prompt, None))  # the holder computes and caches it
                computed, pulled = [], []
                before = _pull_counters(puller)
                sent_before = _descriptor_counters(holder)
                for _ in range(args.repeats):
                    asyncio.run(_reset(puller))
                    computed.append(asyncio.run(_ttft(puller, prompt, None)))
                    asyncio.run(_reset(puller))
                    pulled.append(asyncio.run(_ttft(puller, prompt, holder)))
                pull_s, blocks, num_bytes = (a - b for a, b in zip(_pull_counters(puller), before))
                posts, descriptors = (
                    a - b for a, b in zip(_descriptor_counters(holder), sent_before)
                )
                num_bytes = int(num_bytes)
                row = {
                    "prompt_tokens": n,
                    "blocks_pulled": int(blocks) // args.repeats,
                    "ttft_computed_s": statistics.median(computed),
                    "ttft_pulled_s": statistics.median(pulled),
                    "pull_s": pull_s,
                    "pull_gbps": num_bytes / pull_s / 1e9 if pull_s else 0.0,
                    "memcpy_gbps": _memcpy_gbps(num_bytes // args.repeats) if num_bytes else 0.0,
                    # NIXL descriptors per pull (the holder's vllm:nixl_num_descriptors); None
                    # where the holder does not export them.
                    "descriptors_per_pull": descriptors / args.repeats if posts else None,
                }
                row["ttft_ratio"] = row["ttft_pulled_s"] / row["ttft_computed_s"]
                row["pull_vs_memcpy"] = (
                    row["pull_gbps"] / row["memcpy_gbps"] if row["memcpy_gbps"] else 0.0
                )
                rows.append(row)
                print(
                    f"{n:>6} tokens: TTFT computed {row['ttft_computed_s'] * 1e3:8.1f} ms, pulled "
                    f"{row['ttft_pulled_s'] * 1e3:7.1f} ms ({row['ttft_ratio']:.3f}x); pull "
                    f"{row['blocks_pulled']} blocks in {pull_s / args.repeats * 1e3:.1f} ms = "
                    f"{row['pull_gbps']:.2f} GB/s vs "
                    f"memcpy {row['memcpy_gbps']:.2f} GB/s ({row['pull_vs_memcpy']:.3f}x); "
                    f"descriptors per pull {row['descriptors_per_pull']}",
                    flush=True,
                )
        finally:
            for w in workers:
                w.terminate()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def _descriptor_counters(worker: ServiceProcess) -> tuple[float, float]:
    """NIXL transfers the worker posted so far and their descriptors (0, 0 on code without
    the vllm:nixl_* histograms)."""
    address = worker.metrics_address
    return (
        _metric(address, "vllm:nixl_num_descriptors_count"),
        _metric(address, "vllm:nixl_num_descriptors_sum"),
    )


def _pull_counters(worker: ServiceProcess) -> tuple[float, float, float]:
    """Pull seconds, blocks pulled and bytes received so far (pulls are the only transfers
    into this worker here)."""
    address = worker.metrics_address
    received = [
        line
        for line in urllib.request.urlopen(f"http://{address}/metrics", timeout=5)
        .read()
        .decode()
        .splitlines()
        if line.startswith("pdserve_kv_transfer_bytes_total") and 'direction="receive"' in line
    ]
    return (
        _metric(address, "pdserve_worker_kv_pull_seconds_sum"),
        _metric(address, "pdserve_worker_kv_pull_blocks_total"),
        sum(float(line.rsplit(" ", 1)[1]) for line in received),
    )


if __name__ == "__main__":
    main()
