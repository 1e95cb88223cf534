"""POST /v1/completions (serving shared with chat: router/generation/serve.py)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from router.endpoints.completions.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChunk,
)
from router.generation.serve import generate
from router.http.openapi import GENERATE_ERRORS, route_schema
from router.services import Services


def add_completion_routes(app: FastAPI, services: Services) -> None:
    @app.post(
        "/v1/completions",
        **route_schema(
            CompletionRequest,
            CompletionResponse,
            stream=CompletionStreamChunk,
            errors=GENERATE_ERRORS,
        ),
    )
    async def completions(request: Request) -> Response:
        return await generate(services, "completion", request)
