"""Requests/s of the router's HTTP layer alone: the app in-process (httpx over ASGI, no
sockets, no workers, no etcd), one client at a time. Each case is a request that never
reaches a worker: `/tokenize` (parse + tokenize) and `/v1/completions` refused by validation
(parse + checks + the 400 body), so what is timed is body parsing, validation and the
framework around them.

    .venv/bin/python benchmarks/http_bench.py --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
from cpu_info import cpu_isa

CASES = {
    "tokenize": ("/tokenize", {"prompt": "The quick brown fox jumps over the lazy dog."}, 200),
    "completions_400": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "temperature": -1},
        400,
    ),
    "completions_400_type": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": "2"}, 400),
    "completions_400_4k_ids": (
        "/v1/completions",
        {"prompt": list(range(1000, 5000)), "max_tokens": 2, "temperature": -1},
        400,
    ),
}


async def rate(
    client: httpx.AsyncClient, path: str, body: dict, status: int, seconds: float
) -> tuple[float, float]:
    """Sequential (requests per wall second, requests per CPU second of this process) over
    `seconds` after a short warm-up. On a shared machine the second is the steadier one: the
    client and the app run on this one thread, so it is 1 / CPU time of a request."""
    for _ in range(50):
        r = await client.post(path, json=body)
        assert r.status_code == status, (path, r.status_code, r.text)
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(20):
            await client.post(path, json=body)
        n += 20
    return n / elapsed, n / (time.process_time() - c0)


async def run(seconds: float, repeats: int) -> dict[str, tuple[float, float]]:
    from router.config import RouterConfig
    from router.http.app import create_app
    from router.http.auth import Keys
    from router.server import RouterServices, load_model_card

    config = RouterConfig(etcd="127.0.0.1:1")  # never contacted: the lifespan does not run
    app = create_app(RouterServices(config, load_model_card(config), Keys()))  # no API key
    transport = httpx.ASGITransport(app=app)
    best: dict[str, tuple[float, float]] = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        for _ in range(repeats):
            for name, (path, body, status) in CASES.items():
                wall, cpu = await rate(client, path, body, status, seconds)
                old = best.get(name, (0.0, 0.0))
                best[name] = (max(old[0], wall), max(old[1], cpu))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per case and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="the best repeat is reported")
    args = parser.parse_args()
    results = asyncio.run(run(args.seconds, args.repeats))
    print(f"CPU ISA: {cpu_isa()}")
    print(f"{'':>24}  requests/s  per CPU-s   (best of {args.repeats})")
    for name, (wall, cpu) in results.items():
        print(f"{name:>24}: {wall:10.0f} {cpu:10.0f}")


if __name__ == "__main__":
    main()
