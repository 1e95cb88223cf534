"""The information endpoints (vLLM's): /v1/models[/{id}], /version, /health, /metrics.
/v1/* needs the API key when one is set (router/http/auth.py); /version, /health and /metrics
do not (as vLLM)."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from cluster.roles import Role
from router.endpoints.models.protocol import (
    HealthResponse,
    ModelInfo,
    ModelList,
    VersionResponse,
)
from router.generation.prepare import check_model
from router.http.openapi import route_schema
from router.services import Services


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_model_routes(app: FastAPI, services: Services) -> None:
    card, version = services.card, _version()

    def model_card(lora_name: str | None = None, lora_path: str = "") -> dict[str, Any]:
        """The base model's card, or (vLLM's) a LoRA adapter's: `parent` the base model,
        `root` the adapter's path."""
        if lora_name is None:
            return {
                "id": card.name,
                "object": "model",
                "created": 0,
                "owned_by": "pdserve",
                "root": card.name,
                "parent": None,
                "max_model_len": services.max_model_len(),
            }
        return {
            "id": lora_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "root": lora_path,
            "parent": card.name,
            "max_model_len": services.max_model_len(),
        }

    @app.get("/v1/models", **route_schema(ok=ModelList, errors=(401, 500)))
    async def models() -> dict[str, Any]:
        loras = sorted(services.loras.served().items())
        return {"object": "list", "data": [model_card(), *(model_card(n, p) for n, p in loras)]}

    @app.get("/v1/models/{model_id:path}", **route_schema(ok=ModelInfo, errors=(401, 404, 500)))
    async def model(model_id: str) -> dict[str, Any]:
        lora = check_model(model_id, card, services.loras.served())
        return model_card(*(lora.lora_name, lora.lora_path) if lora else ())

    @app.get("/version", **route_schema(ok=VersionResponse, errors=(500,)))
    async def get_version() -> dict[str, str]:
        return {"version": version}

    @app.get(
        "/health",
        response_model=None,
        responses={
            200: {"model": HealthResponse, "description": "A decode worker is usable"},
            503: {"model": HealthResponse, "description": "No decode worker is usable"},
        },
    )
    async def health() -> Response:
        ready = {role: len(services.registry.ready(role)) for role in Role}
        ok = ready[Role.DECODE] > 0
        return JSONResponse(
            {
                "status": "ok" if ok else "no_decode_workers",
                "decode_workers": ready[Role.DECODE],
                "prefill_workers": ready[Role.PREFILL],
            },
            status_code=200 if ok else 503,
        )

    @app.get(
        "/metrics",
        response_model=None,
        responses={
            200: {
                "description": "Prometheus text format (the router's own registry)",
                "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
            }
        },
    )
    async def metrics() -> Response:
        services.update_gauges()
        return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)
