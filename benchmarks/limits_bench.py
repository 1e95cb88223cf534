"""The router's event loop under oversized inputs (docs/router.md, "Limits"): how long a big
request takes to be answered, and the longest a `GET /health` polled every 10 ms meanwhile
waited (the event loop's stall). One router in a child process (so that its stalls hold no
lock of the measuring process), no workers: /health answers 503, its latency is what counts.

    python benchmarks/limits_bench.py             # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/limits_bench.py   # e.g. before

Cases: an 8 MB /tokenize prompt (refused by its length before tokenizing; before the limits
it was tokenized on the event loop); the same body against a 1 MiB body cap (413 on its
Content-Length); a prompt of the longest text the context can hold (tokenized on the
tokenizer threads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import threading
import time

import httpx
import uvicorn

from cluster.net import free_port
from router.config import RouterConfig
from router.http.app import create_app
from router.http.auth import Keys
from router.server import RouterServices, load_model_card


def _serve(config: RouterConfig) -> None:
    services = RouterServices(config, load_model_card(config), Keys())
    options = {}
    try:
        from router.http.limits import uvicorn_options

        options = uvicorn_options(config.limits)
    except ImportError:  # a checkout without the limits
        pass
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(services),
            host="127.0.0.1",
            port=config.port,
            log_level="error",
            lifespan="off",
            **options,
        )
    )
    asyncio.run(server.serve())


def _start(config: RouterConfig) -> tuple[multiprocessing.Process, str]:
    process = multiprocessing.get_context("spawn").Process(target=_serve, args=(config,))
    process.start()
    url = f"http://127.0.0.1:{config.port}"
    while True:
        try:
            httpx.get(url + "/health")
            return process, url
        except httpx.TransportError:
            time.sleep(0.05)


def _measure(url: str, body: bytes) -> tuple[int, float, float, float]:
    """(status, seconds to the answer, longest /health wait meanwhile, median /health)."""
    result: dict = {}

    def big() -> None:
        start = time.perf_counter()
        r = httpx.post(
            url + "/tokenize",
            content=body,
            timeout=300,
            headers={"Content-Type": "application/json"},
        )
        result.update(status=r.status_code, took=time.perf_counter() - start)

    thread = threading.Thread(target=big)
    waits = []
    with httpx.Client(base_url=url, timeout=300) as client:
        client.get("/health")
        thread.start()
        while thread.is_alive():
            start = time.perf_counter()
            client.get("/health")
            waits.append(time.perf_counter() - start)
            time.sleep(0.01)
    thread.join()
    return result["status"], result["took"], max(waits), statistics.median(waits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base = dict(etcd="127.0.0.1:1")
    card = load_model_card(RouterConfig(**base))
    fits = card.max_model_len * getattr(card, "longest_token_chars", 81)
    cases = [
        ("8 MB prompt", {}, json.dumps({"prompt": "word " * 1_600_000}).encode()),
        ("longest fitting text", {}, json.dumps({"prompt": "word " * (fits // 5)}).encode()),
    ]
    try:
        from router.config import LimitsConfig

        cases.insert(
            1,
            (
                "8 MB prompt, 1 MiB cap",
                {"limits": LimitsConfig(max_request_body_bytes=1 << 20)},
                cases[0][2],
            ),
        )
    except ImportError:
        pass
    for name, extra, body in cases:
        process, url = _start(RouterConfig(**base, port=free_port(), **extra))
        runs = [_measure(url, body) for _ in range(args.repeat)]
        process.terminate()
        process.join()
        status = {r[0] for r in runs}
        took = statistics.median(r[1] for r in runs)
        stall = max(r[2] for r in runs)
        typical = statistics.median(r[3] for r in runs)
        print(
            f"{name:24s} {len(body) / 1e6:5.1f} MB -> {status}  answered in {took * 1e3:8.1f} ms"
            f"  /health: longest {stall * 1e3:7.1f} ms, median {typical * 1e3:5.1f} ms"
        )


if __name__ == "__main__":
    main()
