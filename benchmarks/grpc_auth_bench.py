"""What the cluster plane's authentication costs a router -> worker call (docs/security.md).

The router's own ChannelPool (router/channels.py) calls a worker's gRPC server built as a
worker builds it (`make_grpc_server` + `add_port`), serving `Worker.Health` and
`DecodeWorker.Generate` with a fixed reply (no engine: the transport's cost alone), once per
setup — none, the cluster token, mutual TLS, both — in one process on loopback:
- unary latency: `--calls` sequential Health calls, p50 / p99, and the CPU time per call;
- streaming throughput: `--calls` Generate calls of `--tokens` one-token responses each,
  `--concurrency` at a time (the shape of the router's decode traffic), calls/s and the CPU
  time per call;
- the handshake of a new channel: first call on a fresh channel minus a warm call, median of
  `--handshakes` (TCP only without TLS; TCP + the TLS handshake with it).
The setups take turns, `--rounds` times (each figure: the median of its rounds), so drift in
a shared machine's load falls on all of them alike. Prints each setup's ratio to none, of the
CPU time per call: on a shared machine the wall-clock figures move with the neighbours' load,
the CPU time much less. Client
and server share the process (and its GIL): the figures are the whole CPU cost of a call,
both ends together.

    .venv/bin/python benchmarks/grpc_auth_bench.py [--calls 2000] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cluster.grpc_auth import add_port, aio_channel
from cluster.grpc_security import OPEN, ClusterAuth, GrpcSecurity, resolve
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.channels import ChannelPool

# The throwaway CA the tests use (tests/throwaway_pki.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from throwaway_pki import make_pki, openssl_available  # noqa: E402

TOKEN = "bench-cluster-token-0123456789abcdef"


class _Fixed(pb_grpc.WorkerServicer, pb_grpc.DecodeWorkerServicer):
    """Health answers at once; Generate streams `tokens` one-token responses."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    async def Health(self, request, context):
        return pb.HealthResponse(worker_id="bench", role="decode")

    async def Generate(self, request, context):
        for i in range(self.tokens):
            yield pb.GenerateResponse(token_ids=[i])


@dataclasses.dataclass(frozen=True)
class Row:
    setup: str
    unary_p50_us: float
    unary_p99_us: float
    unary_cpu_us: float
    """CPU time of this process (every thread, both ends) per unary call."""
    stream_calls_per_s: float
    stream_cpu_us: float
    """CPU time per streamed Generate call."""
    new_channel_ms: float


async def _measure(name: str, auth: ClusterAuth, args: argparse.Namespace) -> Row:
    from worker_runtime.runtime import make_grpc_server

    server = make_grpc_server(auth)
    servicer = _Fixed(args.tokens)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{add_port(server, '127.0.0.1:0', auth)}"
    await server.start()
    pool = ChannelPool(auth)
    try:
        worker = pool.worker(address)
        for _ in range(200):  # warm-up: the connection, the handshake, the code paths
            await worker.Health(pb.HealthRequest(), timeout=10)
        latencies = []
        cpu0 = time.process_time()
        for _ in range(args.calls):
            t0 = time.perf_counter()
            await worker.Health(pb.HealthRequest(), timeout=10)
            latencies.append(time.perf_counter() - t0)
        unary_cpu = (time.process_time() - cpu0) / args.calls
        latencies.sort()

        async def generate(i: int) -> None:
            stub = pool.hold_decode(address)
            try:
                async for _ in stub.Generate(pb.GenerateRequest(request_id=f"r{i}"), timeout=30):
                    pass
            finally:
                pool.release(address)

        gate = asyncio.Semaphore(args.concurrency)

        async def limited(i: int) -> None:
            async with gate:
                await generate(i)

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(limited(i) for i in range(args.calls)))
        throughput = args.calls / (time.perf_counter() - t0)
        stream_cpu = (time.process_time() - cpu0) / args.calls

        warm = statistics.median(latencies)
        fresh = []
        for _ in range(args.handshakes):
            t0 = time.perf_counter()
            async with aio_channel(address, auth) as ch:
                await pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=10)
                fresh.append(time.perf_counter() - t0 - warm)
    finally:
        await pool.close_all()
        await server.stop(0)
    return Row(
        name,
        latencies[len(latencies) // 2] * 1e6,
        latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e6,
        unary_cpu * 1e6,
        throughput,
        stream_cpu * 1e6,
        statistics.median(fresh) * 1e3,
    )


def setups(tmp: Path) -> dict[str, ClusterAuth]:
    """none and token; with `openssl`, mutual TLS and mutual TLS + token too."""
    out = {"none": OPEN, "token": ClusterAuth(token=TOKEN, source="bench")}
    if openssl_available():
        pki = make_pki(tmp)
        tls = resolve(
            GrpcSecurity(tls_cert=str(pki.cert), tls_key=str(pki.key), tls_ca=str(pki.ca)), {}
        ).tls
        out["mtls"] = ClusterAuth(tls=tls)
        out["mtls+token"] = ClusterAuth(token=TOKEN, tls=tls, source="bench")
    return out


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _median_row(rows: list[Row]) -> Row:
    return Row(
        rows[0].setup,
        *(statistics.median(getattr(r, f.name) for r in rows) for f in dataclasses.fields(Row)[1:]),
    )


def run(args: argparse.Namespace) -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        auths = setups(Path(tmp))
        rounds = [
            [asyncio.run(_measure(name, auth, args)) for name, auth in auths.items()]
            for _ in range(args.rounds)
        ]
    rows = [_median_row(list(of_setup)) for of_setup in zip(*rounds)]
    base = rows[0]
    print(
        f"{_cpu()}; {args.calls} calls per figure, {args.tokens}-response streams, "
        f"{args.concurrency} concurrent; medians of {args.rounds} rounds"
    )
    print(
        f"{'setup':>11} | {'unary p50':>9} {'p99':>8} {'CPU/call':>9} {'ratio':>5} | "
        f"{'stream calls/s':>14} {'CPU/call':>9} {'ratio':>5} | {'new channel':>11}"
    )
    for r in rows:
        print(
            f"{r.setup:>11} | {r.unary_p50_us:7.0f}us {r.unary_p99_us:6.0f}us "
            f"{r.unary_cpu_us:7.0f}us {r.unary_cpu_us / base.unary_cpu_us:5.2f} | "
            f"{r.stream_calls_per_s:14.0f} {r.stream_cpu_us:7.0f}us "
            f"{r.stream_cpu_us / base.stream_cpu_us:5.2f} | {r.new_channel_ms:9.2f}ms"
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=16, help="responses per Generate stream")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--handshakes", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
