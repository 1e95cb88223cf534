"""What must hold once a chaos run is idle: no worker holds a KV block, the router's KV index
agrees with what the workers have cached, and no long-lived process grew (RSS)."""
from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc

from cluster.registration import WorkerInfo, list_workers, make_client
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc


async def _workers(etcd: str, cluster: str) -> list[WorkerInfo] | None:
    """The non-draining workers, or None while etcd is unreachable (a fault may have just
    restarted it): the callers poll until their deadline."""
    try:
        async with make_client(etcd) as client:
            return [w for w in await list_workers(client, cluster) if not w.draining]
    except Exception:  # aetcd raises its own connection errors
        return None


async def leaked_blocks(etcd: str, cluster: str, timeout_s: float = 60.0) -> dict[str, int]:
    """worker id -> blocks still in use (or requests still running/waiting) after waiting up
    to `timeout_s` for the cluster to go idle; empty when nothing leaked ({"etcd": -1}: the
    workers could not even be listed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = await _workers(etcd, cluster)
        leaks = {"etcd": -1} if workers is None else {}
        for w in workers or ():
            try:
                async with grpc.aio.insecure_channel(w.grpc_address) as ch:
                    c = (await pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=5)).capacity
            except grpc.aio.AioRpcError:
                continue  # gone meanwhile: its pool went with it
            if c.free_blocks != c.total_blocks or c.running or c.waiting:
                leaks[w.worker_id] = c.total_blocks - c.free_blocks or c.running + c.waiting
        if not leaks or time.monotonic() > deadline:
            return leaks
        await asyncio.sleep(0.5)


async def index_mismatch(router_url: str, etcd: str, cluster: str, timeout_s: float = 15.0) -> int:
    """|router's indexed block hashes - the union of the workers' cached hashes| once both
    settled (0 when consistent; -1: the workers could not be listed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cached: set[bytes] = set()
        workers = await _workers(etcd, cluster)
        for w in workers or ():
            async with grpc.aio.insecure_channel(w.grpc_address) as ch:
                reply = await pb_grpc.WorkerStub(ch).GetCachedBlocks(pb.CachedBlocksRequest(), timeout=5)
                cached.update(reply.block_hashes)
        indexed = router_metric(router_url, "pdserve_router_kv_index_blocks")
        diff = -1 if workers is None else abs(int(indexed) - len(cached))
        if diff == 0 or time.monotonic() > deadline:
            return diff
        await asyncio.sleep(0.5)


def router_metric(router_url: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples (matching `labels`) on the router's /metrics."""
    text = urllib.request.urlopen(router_url + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
