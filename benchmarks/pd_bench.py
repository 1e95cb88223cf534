"""TTFT of disaggregated prefill (prefill worker + KV transfer over NIXL) vs local prefill on
the decode worker, for 512 / 2k / 4k-token prompts. Real processes on loopback + real etcd.

  python benchmarks/pd_bench.py [--lengths 512,2048,4096] [--repeats 3] [--num-layers N]
  python benchmarks/pd_bench.py --device cuda --model DIR    # 1P+1D on one GPU (VRAM pools)

The added TTFT of disaggregation = TTFT(disaggregated) - TTFT(local): the transfer that is
not hidden behind the prefill compute (the last chunk's blocks, the notification, the join
on the decode side) plus the extra gRPC hop. Target: <= 15% over local at 2k tokens.
Prompts are random token ids, distinct per run (no prefix-cache hits on either worker).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from cluster.etcd_server import EtcdServer
from cluster.grpc_auth import aio_channel
from cluster.grpc_security import ClusterAuth, GrpcSecurity, resolve, write_token_file
from cluster.net import free_port
from cluster.roles import PrefillPath, Role
from local_cluster.launcher import ServiceProcess
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc


async def _ttft(
    address: str, auth: ClusterAuth, prompt: list[int], prefill: pb.WorkerRef | None
) -> tuple[float, PrefillPath]:
    req = pb.GenerateRequest(
        request_id=f"bench-{random.getrandbits(48)}",
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=1),
    )
    if prefill is not None:
        req.prefill_worker.CopyFrom(prefill)
    async with aio_channel(address, auth) as ch:
        t0 = time.perf_counter()
        async for response in pb_grpc.DecodeWorkerStub(ch).Generate(req, timeout=600):
            return time.perf_counter() - t0, PrefillPath(response.prefill_mode)
    raise RuntimeError("no response")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="512,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="default", help="what both workers load (--model)")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: both workers on the one GPU, KV moved VRAM to VRAM",
    )
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="each worker's KV pool")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="prefill chunk size on both workers"
    )
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="the workers' logs (default: a temp dir)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Start etcd, one prefill and one decode worker; median TTFTs per prompt length."""
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-pd-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    # As `pdserve up` does, but not beside the logs (they may be copied off the machine).
    token_dir = tempfile.TemporaryDirectory(prefix="pdserve-token-")
    token_file = write_token_file(Path(token_dir.name) / "cluster-token")
    auth = resolve(GrpcSecurity(cluster_token_file=str(token_file)), {})
    common = [
        "--model",
        args.model,
        "--device",
        args.device,
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--cluster-token-file",
        str(token_file),
        "--num-threads",
        "1",
        "--dtype",
        args.dtype,
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    if args.num_layers:
        common += ["--num-layers", str(args.num_layers)]
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    rows = []
    with EtcdServer() as etcd:
        ports = {Role.PREFILL: free_port(), Role.DECODE: free_port()}
        procs = {
            role: ServiceProcess(
                [role, "--etcd", etcd.endpoint, "--port", str(port), *common], logs / f"{role}.log"
            )
            for role, port in ports.items()
        }
        try:
            for p in procs.values():
                p.wait_ready(timeout=300)
            decode = f"127.0.0.1:{ports[Role.DECODE]}"
            prefill = pb.WorkerRef(
                worker_id=procs[Role.PREFILL].worker_id, address=f"127.0.0.1:{ports[Role.PREFILL]}"
            )
            # Warm-up: each path once per length (on a GPU the first call of a shape compiles
            # kernels).
            for n in (64, *(int(x) for x in args.lengths.split(","))):
                asyncio.run(_ttft(decode, auth, prompt(n), prefill))
                asyncio.run(_ttft(decode, auth, prompt(n), None))
            print(
                f"{'prompt':>7} {'local TTFT':>11} {'disagg TTFT':>12} {'added':>8} {'added %':>8}"
            )
            for n in (int(x) for x in args.lengths.split(",")):
                local, remote = [], []
                for _ in range(args.repeats):
                    t, mode = asyncio.run(_ttft(decode, auth, prompt(n), None))
                    assert mode is PrefillPath.LOCAL, mode
                    local.append(t)
                    t, mode = asyncio.run(_ttft(decode, auth, prompt(n), prefill))
                    assert mode is PrefillPath.REMOTE, mode
                    remote.append(t)
                lo, re = statistics.median(local), statistics.median(remote)
                rows.append(
                    {
                        "prompt_tokens": n,
                        "local_ttft_ms": round(lo * 1e3, 2),
                        "disagg_ttft_ms": round(re * 1e3, 2),
                        "added_ms": round((re - lo) * 1e3, 2),
                        "added_fraction": round((re - lo) / lo, 4),
                    }
                )
                print(
                    f"{n:7d} {lo * 1000:9.1f}ms {re * 1000:10.1f}ms {(re - lo) * 1000:6.1f}ms "
                    f"{(re - lo) / lo:8.1%}",
                    flush=True,
                )
        finally:
            for p in procs.values():
                p.terminate()
            token_dir.cleanup()
    print(f"(logs in {logs}; medians of {args.repeats} runs; target: added <= 15% at 2048)")
    result = {"device": args.device, "model": args.model, "repeats": args.repeats, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
