"""Requests/s of the router's HTTP layer alone: the app in-process (httpx over ASGI, no
sockets, no workers, no etcd), one client at a time. Each case is a request that never
reaches a worker: `/tokenize` (parse + tokenize) and `/v1/completions` refused by validation
(parse + checks + the 400 body), so what is timed is body parsing, validation and the
framework around them. Requests go to `127.0.0.1:8000` with a same-origin `Origin` header,
as a browser's would, so the Host / Origin check (router/http/host_check.py) runs on each.

`--host-check-ab` also times every case with that check stubbed out (`HostCheck.check`
answering None at once), interleaved with the real one in the same run, and prints the CPU
time per request both ways: what the check costs.

    .venv/bin/python benchmarks/http_bench.py --seconds 3
    .venv/bin/python benchmarks/http_bench.py --seconds 2 --repeats 5 --host-check-ab
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Iterator

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
    "models": ("/v1/models", None, 200),
}
BASE_URL = "http://127.0.0.1:8000"
HEADERS = {"Origin": BASE_URL}
"""A browser's same-origin request: the check reads both headers."""


@contextlib.contextmanager
def host_check_stubbed(stub: bool) -> Iterator[None]:
    """`HostCheck.check` answering None without looking (the cost before the check), or as
    it is."""
    from router.http.host_check import HostCheck

    real = HostCheck.check
    if stub:
        HostCheck.check = lambda self, scope: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        HostCheck.check = real  # type: ignore[method-assign]


async def rate(
    client: httpx.AsyncClient, path: str, body: dict | None, status: int, seconds: float
) -> tuple[float, float]:
    """Sequential (requests per wall second, requests per CPU second of this process) over
    `seconds` after a short warm-up. On a shared machine the second is the steadier one: the
    client and the app run on this one thread, so it is 1 / CPU time of a request."""

    async def one() -> httpx.Response:
        if body is None:
            return await client.get(path, headers=HEADERS)
        return await client.post(path, json=body, headers=HEADERS)

    for _ in range(50):
        r = await one()
        assert r.status_code == status, (path, r.status_code, r.text)
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(20):
            await one()
        n += 20
    return n / elapsed, n / (time.process_time() - c0)


async def run(
    seconds: float, repeats: int, stub_host_check: bool = False
) -> dict[str, tuple[float, float]]:
    """Best (requests/s, requests per CPU-s) of each case over `repeats`."""
    with host_check_stubbed(stub_host_check):
        return await _run(seconds, repeats)


async def _run(seconds: float, repeats: int) -> dict[str, tuple[float, float]]:
    from router.config import RouterConfig
    from router.http.app import create_app
    from router.http.auth import Keys
    from router.server import RouterServices, load_model_card

    config = RouterConfig(etcd="127.0.0.1:1")  # never contacted: the lifespan does not run
    app = create_app(RouterServices(config, load_model_card(config), Keys()))  # no API key
    transport = httpx.ASGITransport(app=app)
    best: dict[str, tuple[float, float]] = {}
    async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
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
    parser.add_argument(
        "--host-check-ab",
        action="store_true",
        help="also time each case with the Host/Origin check stubbed out (interleaved)",
    )
    args = parser.parse_args()
    print(f"CPU ISA: {cpu_isa()}")
    if args.host_check_ab:
        ab(args.seconds, args.repeats)
        return
    results = asyncio.run(run(args.seconds, args.repeats))
    print(f"{'':>24}  requests/s  per CPU-s   (best of {args.repeats})")
    for name, (wall, cpu) in results.items():
        print(f"{name:>24}: {wall:10.0f} {cpu:10.0f}")


def ab(seconds: float, repeats: int) -> None:
    """CPU time per request with the check stubbed (before) and real (after), rounds
    interleaved, best of `repeats` each."""
    best: dict[bool, dict[str, float]] = {False: {}, True: {}}
    for _ in range(repeats):
        for stub in (True, False):
            for name, (_, cpu) in asyncio.run(run(seconds, 1, stub)).items():
                best[stub][name] = max(best[stub].get(name, 0.0), cpu)
    print(f"{'':>24}  CPU us/request: no check   check   delta   (best of {repeats})")
    for name in CASES:
        before, after = 1e6 / best[True][name], 1e6 / best[False][name]
        print(f"{name:>24}: {before:26.1f} {after:7.1f} {after - before:+7.1f}")
    for what, us in check_alone().items():
        print(f"HostCheck.check alone, {what}: {us:.2f} us/call (CPU, best of 5)")


def check_alone(calls: int = 100_000) -> dict[str, float]:
    """CPU us per `HostCheck.check` call on a request scope as uvicorn builds it (a browser's
    headers), for the headers it reads: a same-origin request with Host and Origin, and one
    with Host alone (what API clients send)."""
    from router.http.host_check import HostCheck

    guard = HostCheck("127.0.0.1", (), keyed=False)
    browser = [
        (b"host", b"127.0.0.1:8000"),
        (b"user-agent", b"Mozilla/5.0 (X11; Linux x86_64) Chrome/120.0"),
        (b"accept", b"*/*"),
        (b"accept-encoding", b"gzip, deflate, br"),
        (b"content-type", b"application/json"),
        (b"content-length", b"64"),
        (b"origin", BASE_URL.encode()),
    ]
    out = {}
    for what, headers in (
        ("Host + Origin", browser),
        ("Host only", [h for h in browser if h[0] != b"origin"]),
    ):
        scope = {"type": "http", "scheme": "http", "headers": headers}
        assert guard.check(scope) is None
        best = float("inf")
        for _ in range(5):
            c0 = time.process_time()
            for _ in range(calls):
                guard.check(scope)
            best = min(best, time.process_time() - c0)
        out[what] = best / calls * 1e6
    return out


if __name__ == "__main__":
    main()
