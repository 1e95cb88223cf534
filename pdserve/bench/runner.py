"""Drives the load: request i arrives at arrival_offsets()[i] seconds into the run (a Poisson
process at `request_rate`, or all at t=0 when the rate is inf), waits for a slot when
`max_concurrency` is set, then streams. The run ends when every request has finished or at
the deadline (`timeout_s`), whichever comes first; a tqdm bar counts finished requests."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from pdserve.bench.client import OpenAIClient, RequestResult, fetch_default_model
from pdserve.bench.config import BenchConfig
from pdserve.bench.workload import RequestSpec

CANCELLED = "cancelled at the run deadline"
UNSENT = "not sent before the run deadline"


@dataclass(frozen=True)
class BenchRun:
    model: str
    results: list[RequestResult]
    """One per spec, in spec order."""
    duration_s: float
    """From the first arrival to the end of the run (last request finished, or the deadline)."""
    timed_out: bool
    started_at: float
    """Wall-clock time (Unix seconds) when the run began."""


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start of the run at which each of n requests arrives: 0 for all when
    rate is inf, else a Poisson process (exponential gaps of mean 1/rate; the first at 0)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_benchmark(cfg: BenchConfig, specs: list[RequestSpec]) -> BenchRun:
    """Run the load described by cfg.load against cfg.endpoint (blocking)."""
    return asyncio.run(_run(cfg, specs))


async def _run(cfg: BenchConfig, specs: list[RequestSpec]) -> BenchRun:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as http:
        model = cfg.endpoint.model or await fetch_default_model(http, cfg.endpoint)
        client = OpenAIClient(http, cfg.endpoint, model)
        load = cfg.load
        slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        results = [RequestResult(index=s.index) for s in specs]
        offsets = arrival_offsets(len(specs), load.request_rate, cfg.workload.seed)
        bar = tqdm(total=len(specs), desc="bench", unit="req", disable=not load.progress)
        started_at, t0 = time.time(), time.perf_counter()

        async def one(spec: RequestSpec, result: RequestResult, offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            if slots is not None:
                async with slots:
                    await send(spec, result)
            else:
                await send(spec, result)
            bar.update(1)

        async def send(spec: RequestSpec, result: RequestResult) -> None:
            result.start = time.perf_counter() - t0
            try:
                await client.stream(spec, result)
            except asyncio.CancelledError:
                result.error = CANCELLED
                raise
            except Exception as exc:  # a malformed response must not stop the run
                result.error = f"{type(exc).__name__}: {exc}"

        tasks = [asyncio.create_task(one(s, r, o)) for s, r, o in zip(specs, results, offsets)]
        try:
            _, pending = await asyncio.wait(tasks, timeout=load.timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            bar.close()
        duration = time.perf_counter() - t0
        for r in results:
            if r.start is None:
                r.error = UNSENT
        return BenchRun(
            model=model,
            results=results,
            duration_s=duration,
            timed_out=bool(pending),
            started_at=started_at,
        )
