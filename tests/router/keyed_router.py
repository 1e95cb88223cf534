"""A router with two tenants' API keys and an admin key, served by uvicorn on loopback (lifespan
off: no etcd), over a stand-in dispatcher the test passes: the server of the per-key limit tests
through HTTP (test_router_key_limits.py, test_router_compile_limits.py)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
import uvicorn

from cluster.net import free_port
from router.config import LimitsConfig, RouterConfig
from router.generation.model_card import ModelCard
from router.http.app import create_app
from router.http.auth import resolve_keys
from router.server import RouterServices

KEY_A, KEY_B, ADMIN = "tenant-a-key-0123456", "tenant-b-key-0123456", "admin-key-1-0123456"


@asynccontextmanager
async def keyed_router(
    card: ModelCard, dispatcher: Any, timeout: float, **limits: Any
) -> AsyncIterator[tuple[RouterServices, httpx.AsyncClient]]:
    """(services, a client of the served app, `timeout` seconds a request) until exit; then
    the server stops (wait for at most 10 s: release what the dispatcher holds before) and
    the grammar compile pool closes. `limits`: LimitsConfig's fields."""
    config = RouterConfig(
        etcd="127.0.0.1:1",
        api_key=(KEY_A, KEY_B),
        admin_api_key=(ADMIN,),
        limits=LimitsConfig(**limits),
    )
    services = RouterServices(config, card, resolve_keys(config, {}))
    app = create_app(services)
    services.dispatcher = dispatcher  # the handlers look it up per request
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()  # it could not start: its error
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=timeout
        ) as client:
            yield services, client
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        services.grammars.close()
