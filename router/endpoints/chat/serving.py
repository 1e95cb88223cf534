"""POST /v1/chat/completions (serving shared with completions: router/generation/serve.py)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from router.endpoints.chat.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChunk,
)
from router.generation.serve import generate
from router.http.openapi import GENERATE_ERRORS, route_schema
from router.services import Services


def add_chat_routes(app: FastAPI, services: Services) -> None:
    @app.post(
        "/v1/chat/completions",
        **route_schema(
            ChatCompletionRequest,
            ChatCompletionResponse,
            stream=ChatCompletionStreamChunk,
            errors=GENERATE_ERRORS,
        ),
    )
    async def chat_completions(request: Request) -> Response:
        return await generate(services, "chat", request)
