"""An asyncio loop on a background thread hosting fake workers and in-process routers, so
tests can drive them with blocking clients (the official `openai` client, httpx)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Coroutine, TypeVar

import uvicorn
from router_fakes import FakeWorker

from cluster.net import free_port
from router.config import PlacementConfig, RouterConfig
from router.http.app import create_app
from router.http.auth import resolve_keys
from router.http.limits import uvicorn_options
from router.server import RouterServices, load_model_card

T = TypeVar("T")


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class RunningRouter:
    services: RouterServices
    server: uvicorn.Server
    task: asyncio.Task
    url: str

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


_CARD: dict = {}  # (model, max_model_len, generation config) -> ModelCard: loaded once


async def start_router(
    etcd: str, cluster: str, placement: PlacementConfig | None = None, **config: Any
) -> RunningRouter:
    port = free_port()
    cfg = RouterConfig(
        etcd=etcd, cluster=cluster, port=port, placement=placement or PlacementConfig(), **config
    )
    key = (cfg.model, cfg.max_model_len, cfg.generation_config, cfg.chat)
    if key not in _CARD:
        _CARD[key] = load_model_card(cfg)
    services = RouterServices(cfg, _CARD[key], resolve_keys(cfg, {}))  # flags only, no environment
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(services),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            **uvicorn_options(cfg.limits),
        )
    )
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return RunningRouter(services, server, task, f"http://127.0.0.1:{port}")


async def stop_router(router: RunningRouter) -> None:
    router.server.should_exit = True
    await asyncio.wait_for(router.task, 10)


async def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


@dataclass
class FakeCluster:
    """Fake workers + an in-process router, all on the background loop."""

    bg: LoopThread
    workers: dict[str, FakeWorker]
    router: RunningRouter

    @property
    def base_url(self) -> str:
        return self.router.base_url

    @property
    def services(self) -> RouterServices:
        return self.router.services

    def stop(self) -> None:
        async def main():
            await stop_router(self.router)
            for w in self.workers.values():
                await w.stop()

        self.bg.run(main())


def start_cluster(
    bg: LoopThread,
    etcd: str,
    cluster: str,
    specs: list[tuple[str, str]],
    placement: PlacementConfig | None = None,
    **config: Any,
) -> FakeCluster:
    async def main():
        workers = {wid: await FakeWorker(role, etcd, cluster, wid).start() for role, wid in specs}
        router = await start_router(etcd, cluster, placement, **config)
        await wait_for(lambda: len(router.services.registry.all()) == len(specs))
        subs = router.services.kv_subscriptions
        await wait_for(lambda: all(e.is_set() for e in subs.synced.values()))
        return FakeCluster(bg, workers, router)

    return bg.run(main())
