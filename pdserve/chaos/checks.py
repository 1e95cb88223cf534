"""What must hold once a chaos run is idle: no worker holds a KV block, no second-tier slot is
held beyond the blocks its worker announces, the router's KV index agrees with what the
workers have cached (pools and tiers), and no long-lived process grew (RSS)."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, TypeVar

import grpc

from cluster.etcd_security import EtcdCredentials
from cluster.grpc_auth import aio_channel
from cluster.grpc_security import ClusterAuth
from cluster.registration import WorkerInfo, list_workers, make_client
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Settled(Generic[T]):
    """What a check read from the cluster, and who did not answer meanwhile."""

    value: T
    unsettled: dict[str, str]
    """Who did not answer, and why: worker id -> the RPC's status (a worker killed late is
    still registered until its lease lapses), "etcd": the workers could not be listed,
    "router": its /metrics did not answer. Empty: every registered worker answered."""


async def _workers(
    etcd: str, cluster: str, credentials: EtcdCredentials | None
) -> list[WorkerInfo] | None:
    """The non-draining workers, or None while etcd is unreachable (a fault may have just
    restarted it): the callers poll until their deadline."""
    try:
        async with make_client(etcd, credentials) as client:
            return [w for w in await list_workers(client, cluster) if not w.draining]
    except Exception:  # aetcd raises its own connection errors
        return None


async def sweep(
    etcd: str,
    cluster: str,
    auth: ClusterAuth,
    call: Callable[[pb_grpc.WorkerStub], Awaitable[Any]],
    credentials: EtcdCredentials | None = None,
) -> Settled[dict[str, Any]]:
    """`call` on every registered worker (presenting `auth`): worker id -> its reply. A worker
    that refuses or times out is unsettled, never an exception."""
    workers = await _workers(etcd, cluster, credentials)
    if workers is None:
        return Settled({}, {"etcd": "the workers could not be listed"})
    replies: dict[str, Any] = {}
    unsettled: dict[str, str] = {}
    for w in workers:
        try:
            async with aio_channel(w.grpc_address, auth) as ch:
                replies[w.worker_id] = await call(pb_grpc.WorkerStub(ch))
        except grpc.aio.AioRpcError as exc:
            unsettled[w.worker_id] = f"{exc.code().name}: {exc.details()}"
    return Settled(replies, unsettled)


async def settle(
    etcd: str,
    cluster: str,
    auth: ClusterAuth,
    call: Callable[[pb_grpc.WorkerStub], Awaitable[Any]],
    measure: Callable[[Settled[dict[str, Any]]], Settled[T]],
    ok: Callable[[T], bool],
    timeout_s: float,
    credentials: EtcdCredentials | None = None,
) -> Settled[T]:
    """`sweep` with `call` every 0.5 s and `measure` the replies, until every registered worker
    answers (a dead one's registration lapses with its lease) and the value is `ok`, or
    `timeout_s` ran out: the last measurement, with what had not settled."""
    deadline = time.monotonic() + timeout_s
    while True:
        check = measure(await sweep(etcd, cluster, auth, call, credentials))
        if (not check.unsettled and ok(check.value)) or time.monotonic() > deadline:
            return check
        await asyncio.sleep(0.5)


def _health(stub: pb_grpc.WorkerStub) -> Awaitable[pb.HealthResponse]:
    return stub.Health(pb.HealthRequest(), timeout=5)


def _cached_blocks(stub: pb_grpc.WorkerStub) -> Awaitable[pb.CachedBlocksResponse]:
    return stub.GetCachedBlocks(pb.CachedBlocksRequest(), timeout=5)


async def leaked_blocks(
    etcd: str,
    cluster: str,
    auth: ClusterAuth,
    timeout_s: float = 60.0,
    credentials: EtcdCredentials | None = None,
) -> Settled[dict[str, int]]:
    """worker id -> blocks still in use (or requests still running/waiting) once the cluster
    went idle, waiting up to `timeout_s`; empty when nothing leaked."""

    def leaks(s: Settled[dict[str, Any]]) -> Settled[dict[str, int]]:
        held = {}
        for worker_id, reply in s.value.items():
            c = reply.capacity
            if c.free_blocks != c.total_blocks or c.running or c.waiting:
                held[worker_id] = c.total_blocks - c.free_blocks or c.running + c.waiting
        return Settled(held, s.unsettled)

    return await settle(
        etcd, cluster, auth, _health, leaks, lambda held: not held, timeout_s, credentials
    )


async def stranded_tier_blocks(
    etcd: str,
    cluster: str,
    auth: ClusterAuth,
    timeout_s: float = 15.0,
    credentials: EtcdCredentials | None = None,
) -> Settled[dict[str, int]]:
    """worker id -> second-tier slots held beyond the tier blocks it announces (KV events,
    GetCachedBlocks), once idle, waiting up to `timeout_s`; empty when every tier holds
    exactly what its worker announces (a slot held by nothing would be lost capacity)."""

    async def both(stub: pb_grpc.WorkerStub) -> tuple[pb.HealthResponse, pb.CachedBlocksResponse]:
        return await _health(stub), await _cached_blocks(stub)

    def stranded(s: Settled[dict[str, Any]]) -> Settled[dict[str, int]]:
        held = {}
        for worker_id, (health, cached) in s.value.items():
            extra = health.capacity.kv_offload_used_blocks - sum(cached.tiers)
            if extra:
                held[worker_id] = extra
        return Settled(held, s.unsettled)

    return await settle(
        etcd, cluster, auth, both, stranded, lambda held: not held, timeout_s, credentials
    )


async def index_mismatch(
    router_url: str,
    etcd: str,
    cluster: str,
    auth: ClusterAuth,
    timeout_s: float = 15.0,
    credentials: EtcdCredentials | None = None,
) -> Settled[int]:
    """|router's indexed block hashes - the union of the workers' cached hashes| once both
    settled, waiting up to `timeout_s` (0 when consistent; -1: the workers could not be
    listed, or the router's /metrics did not answer)."""

    def mismatch(s: Settled[dict[str, Any]]) -> Settled[int]:
        if "etcd" in s.unsettled:
            return Settled(-1, s.unsettled)
        try:
            indexed = router_metric(router_url, "pdserve_router_kv_index_blocks")
        except OSError as exc:  # the router restarting (a late restart-router fault)
            return Settled(-1, {**s.unsettled, "router": repr(exc)})
        cached = {h for reply in s.value.values() for h in reply.block_hashes}
        return Settled(abs(int(indexed) - len(cached)), s.unsettled)

    return await settle(
        etcd,
        cluster,
        auth,
        _cached_blocks,
        mismatch,
        lambda diff: diff == 0,
        timeout_s,
        credentials,
    )


def router_metric(router_url: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples (matching `labels`) on the router's (or any) /metrics."""
    text = urllib.request.urlopen(router_url + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def workers_metric(
    etcd: str, cluster: str, name: str, credentials: EtcdCredentials | None = None, **labels: str
) -> float:
    """Sum of a metric over the registered workers' /metrics (each since its own start: a
    restarted worker counts from 0); unreachable ones count 0."""
    total = 0.0
    for w in await _workers(etcd, cluster, credentials) or []:
        try:
            total += router_metric(f"http://{w.metrics_address}", name, **labels)
        except OSError:
            pass
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
