"""TTFT of disaggregated prefill (prefill worker + KV transfer over NIXL) vs local prefill on
the decode worker, for 512 / 2k / 4k-token prompts. Real processes on loopback + real etcd.

  python -m benchmarks.pd_bench [--lengths 512,2048,4096] [--repeats 3] [--num-layers N]

The added TTFT of disaggregation = TTFT(disaggregated) - TTFT(local): the transfer that is
not hidden behind the prefill compute (the last chunk's blocks, the notification, the join
on the decode side) plus the extra gRPC hop. Target: <= 15% over local at 2k tokens.
Prompts are random token ids, distinct per run (no prefix-cache hits on either worker).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from cluster.etcd_server import EtcdServer
from local_cluster.launcher import ServiceProcess
from cluster.net import free_port
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc


async def _ttft(address: str, prompt: list[int], prefill: pb.WorkerRef | None) -> tuple[float, str]:
    req = pb.GenerateRequest(request_id=f"bench-{random.getrandbits(48)}", prompt_token_ids=prompt,
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=1))
    if prefill is not None:
        req.prefill_worker.CopyFrom(prefill)
    async with grpc.aio.insecure_channel(address) as ch:
        t0 = time.perf_counter()
        async for response in pb_grpc.DecodeWorkerStub(ch).Generate(req, timeout=600):
            return time.perf_counter() - t0, response.prefill_mode
    raise RuntimeError("no response")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="prefill chunk size on both workers")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="pdserve-pd-bench-"))
    common = ["--kv-cache-memory", "1GiB", "--num-threads", "1", "--dtype", args.dtype,
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.num_layers:
        common += ["--num-layers", str(args.num_layers)]
    rng = random.Random(0)
    with EtcdServer() as etcd:
        ports = {"prefill": free_port(), "decode": free_port()}
        procs = {
            role: ServiceProcess([role, "--etcd", etcd.endpoint, "--port", str(port), *common],
                                 logs / f"{role}.log")
            for role, port in ports.items()
        }
        try:
            for p in procs.values():
                p.wait_ready()
            decode = f"127.0.0.1:{ports['decode']}"
            prefill = pb.WorkerRef(worker_id=procs["prefill"].worker_id, address=f"127.0.0.1:{ports['prefill']}")
            asyncio.run(_ttft(decode, [rng.randrange(100, 40000) for _ in range(64)], prefill))  # warm-up
            asyncio.run(_ttft(decode, [rng.randrange(100, 40000) for _ in range(64)], None))
            print(f"{'prompt':>7} {'local TTFT':>11} {'disagg TTFT':>12} {'added':>8} {'added %':>8}")
            for n in (int(x) for x in args.lengths.split(",")):
                local, remote = [], []
                for _ in range(args.repeats):
                    t, mode = asyncio.run(_ttft(decode, [rng.randrange(100, 40000) for _ in range(n)], None))
                    assert mode == "local", mode
                    local.append(t)
                    t, mode = asyncio.run(_ttft(decode, [rng.randrange(100, 40000) for _ in range(n)], prefill))
                    assert mode == "remote", mode
                    remote.append(t)
                lo, re = statistics.median(local), statistics.median(remote)
                print(f"{n:7d} {lo * 1000:9.0f}ms {re * 1000:10.0f}ms {(re - lo) * 1000:6.0f}ms "
                      f"{(re - lo) / lo:8.1%}")
        finally:
            for p in procs.values():
                p.terminate()
    print(f"(logs in {logs}; medians of {args.repeats} runs; target: added <= 15% at 2048)")


if __name__ == "__main__":
    main()
