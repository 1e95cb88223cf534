"""LoRA adapters across the cluster: which are served (and so listed in /v1/models and
selectable by `model`), and vLLM's runtime endpoints that load / unload one on every worker.

An adapter is served when this router was started with it (`--lora-modules`), loaded it
through `/v1/load_lora_adapter`, or any registered worker publishes it (`WorkerInfo.loras`:
a worker started with `--lora-modules`, or loaded by another router). Requests carry the
adapter's name and path, so a worker that has not loaded it yet (a new worker, one that
evicted it) loads it on first use; its id is `engine.lora_id_for(name)` everywhere.

Load: every registered worker of both pools loads it (concurrently); if any refuses, the
ones that loaded it unload it again and the client gets the first refusal (a missing path:
404, an invalid adapter: 400, a worker failing: 502). Unload: the adapter stops being
served here at once (new requests for it are 404), then every worker drops it; requests
running with it finish with it. Both wait (briefly) until the workers' republished
registrations agree, so /v1/models reflects the change when the call returns.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from cluster.registration import WorkerInfo
from engine.config import LoRAModule
from engine.lora.request import lora_id_for
from proto import pdserve_pb2 as pb
from router.channels import ChannelPool
from router.endpoints.base import parse_json
from router.endpoints.loras.protocol import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from router.http.errors import APIError, bad_request
from router.http.openapi import route_schema
from router.placement.registry import WorkerRegistry

log = logging.getLogger(__name__)

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_RPC_TIMEOUT_S = 60.0
_AGREE_TIMEOUT_S = 2.0  # waiting for the workers' republished registrations
_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404}


def runtime_updates_allowed(enable_lora: bool) -> bool:
    """`--enable-lora` on the router, or vLLM's switch in the environment."""
    return enable_lora or os.environ.get(RUNTIME_UPDATES_ENV, "").lower() in ("1", "true")


class LoRAAdapters:
    """The adapters served (name -> path) and the cluster-wide load / unload."""

    def __init__(
        self,
        registry: WorkerRegistry,
        channels: ChannelPool,
        lora_modules: tuple[LoRAModule, ...] = (),
    ) -> None:
        self.registry = registry
        self.channels = channels
        self._own: dict[str, str] = dict(lora_modules)
        self._removed: set[str] = set()  # unloaded here: ignored in registrations until gone
        self._lock = asyncio.Lock()

    def served(self) -> dict[str, str]:
        """name -> path of every adapter served now."""
        out: dict[str, str] = {}
        for state in self.registry.all():
            for name, path in state.info.loras.items():
                if name not in self._removed:
                    out.setdefault(name, path)
        out.update(self._own)
        return out

    async def load(self, name: str, path: str) -> None:
        """Raises APIError (see the module docstring)."""
        async with self._lock:
            if name in self.served():
                raise bad_request(
                    f"The lora adapter '{name}' has already been loaded.", "lora_name"
                )
            workers = self._workers()
            results = await asyncio.gather(
                *(
                    self._call(
                        w,
                        "LoadLoRAAdapter",
                        pb.LoadLoRARequest(adapter=pb.LoRAAdapter(name=name, path=path)),
                    )
                    for w in workers
                )
            )
            failed = [
                (w, r) for w, r in zip(workers, results) if isinstance(r, grpc.aio.AioRpcError)
            ]
            if failed:
                loaded = [w for w, r in zip(workers, results) if not isinstance(r, Exception)]
                await asyncio.gather(
                    *(
                        self._call(w, "UnloadLoRAAdapter", pb.UnloadLoRARequest(name=name))
                        for w in loaded
                    )
                )
                raise _refusal(*failed[0])
            self._removed.discard(name)
            self._own[name] = path
            await self._until(lambda info: name in info.loras, workers)
        log.info("loaded LoRA adapter %r from %s on %d workers", name, path, len(workers))

    async def unload(self, name: str) -> None:
        async with self._lock:
            if name not in self.served():
                raise APIError(
                    404,
                    f"The lora adapter '{name}' cannot be found.",
                    "lora_name",
                    "model_not_found",
                )
            self._own.pop(name, None)
            self._removed.add(name)  # no new request selects it from here on
            workers = self._workers()
            results = await asyncio.gather(
                *(
                    self._call(w, "UnloadLoRAAdapter", pb.UnloadLoRARequest(name=name))
                    for w in workers
                )
            )
            await self._until(lambda info: name not in info.loras, workers)
            failed = [
                (w, r) for w, r in zip(workers, results) if isinstance(r, grpc.aio.AioRpcError)
            ]
            if not any(name in s.info.loras for s in self.registry.all()):
                self._removed.discard(name)  # no registration lists it: nothing to hide
            if failed:
                raise _refusal(*failed[0])
        log.info("unloaded LoRA adapter %r from %d workers", name, len(workers))

    def name_for_id(self, lora_int_id: int) -> str | None:
        return next((n for n in self.served() if lora_id_for(n) == lora_int_id), None)

    def _workers(self) -> list[WorkerInfo]:
        workers = [s.info for s in self.registry.all() if not s.info.draining]
        if not workers:
            raise APIError(
                503,
                "No worker is registered to load the adapter on; try again when workers are up.",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        return workers

    async def _call(self, info: WorkerInfo, method: str, request) -> Any:
        rpc = getattr(self.channels.worker(info.grpc_address), method)
        try:
            return await rpc(request, timeout=_RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "%s on %s failed: %s: %s", method, info.worker_id, exc.code().name, exc.details()
            )
            return exc

    async def _until(self, agrees, workers: list[WorkerInfo]) -> None:
        """Wait until the registry's view of `workers` (those still registered) agrees."""
        ids = {w.worker_id for w in workers}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _AGREE_TIMEOUT_S
        while loop.time() < deadline:
            states = [s for s in self.registry.all() if s.info.worker_id in ids]
            if all(agrees(s.info) for s in states):
                return
            await self.registry.wait_changed(max(0.0, deadline - loop.time()))


def _refusal(worker: WorkerInfo, exc: grpc.aio.AioRpcError) -> APIError:
    status = _STATUS.get(exc.code(), 502)
    message = (
        exc.details()
        if status < 500
        else (f"worker {worker.worker_id} failed: {exc.code().name}: {exc.details()}")
    )
    return APIError(
        status,
        message,
        "lora_path" if status == 404 else None,
        "model_not_found" if status == 404 else "worker_failed" if status == 502 else None,
    )


_ERRORS = (400, 401, 403, 404, 500, 502, 503)
_DISABLED = (
    "Runtime LoRA updating is disabled: start the router with --enable-lora (or set "
    f"{RUNTIME_UPDATES_ENV}=true)"
)


def _schema(request) -> dict[str, Any]:
    kw = route_schema(request, errors=_ERRORS)
    kw["responses"][200] = {
        "description": "Success (plain text, as vLLM)",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
    kw["responses"][404] = {
        **kw["responses"][404],
        "description": "Unknown adapter, adapter path not found, or runtime LoRA updating disabled",
    }
    return kw


def add_lora_routes(app: FastAPI, adapters: LoRAAdapters, enabled: bool) -> None:
    """vLLM's runtime LoRA endpoints. Disabled: 404, as vLLM without the switch."""

    @app.post("/v1/load_lora_adapter", **_schema(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        if not enabled:
            raise APIError(404, _DISABLED)
        req = parse_json(LoadLoRAAdapterRequest, await request.body())
        if not req.lora_name or not req.lora_path:
            raise bad_request(
                "Both 'lora_name' and 'lora_path' must be provided.",
                "lora_name" if not req.lora_name else "lora_path",
            )
        await adapters.load(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", **_schema(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        if not enabled:
            raise APIError(404, _DISABLED)
        req = parse_json(UnloadLoRAAdapterRequest, await request.body())
        name = req.lora_name
        if not name and req.lora_int_id is not None:
            name = adapters.name_for_id(req.lora_int_id)
            if name is None:
                raise APIError(
                    404,
                    f"The lora adapter with id {req.lora_int_id} cannot be found.",
                    "lora_int_id",
                    "model_not_found",
                )
        if not name:
            raise bad_request(
                "either 'lora_name' and 'lora_int_id' needs to be provided.", "lora_name"
            )
        await adapters.unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
