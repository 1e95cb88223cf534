"""Multi-process test harness: real etcd, `pdserve prefill` / `pdserve decode` processes on
free loopback ports, stopped by PID by the test that started them."""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc

from cluster.net import free_port
from cluster.registration import WorkerInfo, list_workers, make_client
from local_cluster.launcher import ServiceProcess
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

NUM_LAYERS = 2


class WorkerProcess(ServiceProcess):
    """A `pdserve prefill|decode` process with the test settings (2 layers, fp32, 1 thread)."""

    def __init__(
        self, role: str, etcd_endpoint: str, *extra: str, log_dir: Path, cluster: str = "default"
    ):
        self.role = role
        self.port = free_port()
        super().__init__(
            [
                role,
                "--etcd",
                etcd_endpoint,
                "--cluster",
                cluster,
                "--port",
                str(self.port),
                "--num-layers",
                str(NUM_LAYERS),
                "--kv-cache-memory",
                "32MiB",
                "--num-threads",
                "1",
                "--dtype",
                "float32",  # exact parity with the fp32 reference engine
                *extra,
            ],
            log_dir / f"{role}-{self.port}.log",
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ref(self) -> pb.WorkerRef:
        return pb.WorkerRef(worker_id=self.worker_id, address=self.address)


async def ahealth(address: str) -> pb.HealthResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=10)


@contextmanager
def remote_prefill_cluster(
    logs: Path, cluster: str, worker_args: tuple[str, ...] = (), router_args: tuple[str, ...] = ()
) -> Iterator[tuple[str, "WorkerProcess", "WorkerProcess"]]:
    """etcd + one prefill and one decode worker (both given `worker_args`) + a router that
    prefills every prompt on the prefill worker (`router_args` added). Yields (router URL,
    prefill, decode) once the router sees both workers; stops them all by PID and checks that
    each exited cleanly."""
    from cluster.etcd_server import EtcdServer

    with EtcdServer() as etcd:
        prefill = WorkerProcess(
            "prefill", etcd.endpoint, *worker_args, log_dir=logs, cluster=cluster
        )
        decode = WorkerProcess("decode", etcd.endpoint, *worker_args, log_dir=logs, cluster=cluster)
        port = free_port()
        router = ServiceProcess(
            [
                "router",
                "--etcd",
                etcd.endpoint,
                "--cluster",
                cluster,
                "--port",
                str(port),
                "--local-prefill-threshold",
                "0",
                "--local-prefill-max-tokens",
                "0",
                *router_args,
            ],
            logs / "router.log",
        )
        url = f"http://127.0.0.1:{port}"
        try:
            prefill.wait_ready()
            decode.wait_ready()
            for worker in (prefill, decode):  # before READY (cluster/heap.py)
                assert "start-up heap frozen" in worker.log_path.read_text(), worker.log_path
            wait_router_sees(url, router)
            assert "start-up heap frozen" in router.log_path.read_text()  # once uvicorn is up
            yield url, prefill, decode
        finally:
            codes = [p.terminate(30) for p in (router, decode, prefill)]
    assert codes == [0, 0, 0]


def wait_router_sees(
    url: str, router: ServiceProcess, prefill: int = 1, decode: int = 1, timeout: float = 60.0
) -> None:
    """Wait until the router at `url` has that many workers of each pool registered."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            h = httpx.get(url + "/health", timeout=2).json()
            if h.get("decode_workers") == decode and h.get("prefill_workers") == prefill:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and router.alive(), "router not ready"
        time.sleep(0.2)


def health(address: str) -> pb.HealthResponse:
    return asyncio.run(ahealth(address))


def wait_all_blocks_free(address: str, timeout: float = 5.0) -> pb.HealthResponse:
    """Every block back on the free list (free or cached-free); nothing running or parked."""
    deadline = time.monotonic() + timeout
    while True:
        h = health(address)
        c = h.capacity
        if c.free_blocks == c.total_blocks and c.running == 0 and c.waiting == 0:
            return h
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{address}: {c.total_blocks - c.free_blocks} blocks still in use, {c}"
            )
        time.sleep(0.05)


async def registration(etcd: str, worker: WorkerProcess, cluster: str = "default") -> WorkerInfo:
    """`worker`'s registration as the etcd at `etcd` holds it."""
    async with make_client(etcd) as client:
        workers = await list_workers(client, cluster)
    [info] = [i for i in workers if i.worker_id == worker.worker_id]
    return info


def decode_request(
    rid: str, tokens: list[int], prefill: WorkerProcess | None = None, **sampling
) -> pb.GenerateRequest:
    """A decode worker's Generate request: greedy, 12 tokens unless `sampling` says otherwise;
    prefilled on `prefill` when given."""
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 12)
    req = pb.GenerateRequest(
        request_id=rid, prompt_token_ids=tokens, sampling=pb.SamplingParams(**sampling)
    )
    if prefill is not None:
        req.prefill_worker.CopyFrom(prefill.ref())
    return req


async def generate(address: str, request: pb.GenerateRequest, timeout: float = 120.0):
    """All responses of one Generate call."""
    async with grpc.aio.insecure_channel(address) as ch:
        return [r async for r in pb_grpc.DecodeWorkerStub(ch).Generate(request, timeout=timeout)]


def tokens_by_index(responses) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in responses:
        out.setdefault(r.index, []).extend(r.token_ids)
    return out


def metric(address: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples (matching `labels`) from a /metrics endpoint."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def cancel_once_started(
    decode_address: str, request: pb.GenerateRequest, started, timeout: float = 30.0
) -> None:
    """Start `request` on the decode worker, cancel the call as soon as `await started()` is
    true (e.g. the prefill worker computes it), and check that the call ended cancelled."""

    async def run():
        async with grpc.aio.insecure_channel(decode_address) as ch:
            call = pb_grpc.DecodeWorkerStub(ch).Generate(request)
            task = asyncio.ensure_future(call.read())
            deadline = time.monotonic() + timeout
            while not await started():
                assert time.monotonic() < deadline and not task.done(), "never started"
                await asyncio.sleep(0.01)
            call.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return
            raise AssertionError("the cancelled call returned")

    asyncio.run(run())


def rank_children(pid: int) -> list[int]:
    """The tensor-parallel ranks a worker process started."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and "engine.parallel.rank_worker" in cmd:
            out.append(int(entry))
    return out
