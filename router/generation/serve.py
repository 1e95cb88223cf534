"""Serving a completion or chat request: prepare (validate, tokenize; off the loop for a
large body), dispatch, then answer collected or streamed (router/generation/run.py) with the
OpenAI bodies (router/generation/bodies.py)."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from router.generation.bodies import ChunkWriter, Collector
from router.generation.prepare import Kind, prepare
from router.generation.run import answer, count_tool_calls, dispatch
from router.services import Services


async def generate(services: Services, kind: Kind, request: Request) -> Response:
    arrival = time.monotonic()
    body = await request.body()
    prepared = await services.tokenizing(
        len(body),
        prepare,
        kind,
        body,
        services.card,
        services.max_model_len(),
        services.loras.served(),
        services.config.limits,
    )
    streams = await dispatch(services, request, prepared, arrival)
    # As vLLM: the client's X-Request-Id header, else the body's request_id, else a fresh one.
    base = request.headers.get("x-request-id") or prepared.request_id or uuid.uuid4().hex
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{base}"
    details = services.config.enable_prompt_tokens_details
    writer = (ChunkWriter if prepared.stream else Collector)(
        prepared, services.tokens, request_id, details
    )

    def ended(completed: bool) -> None:
        count_tool_calls(services, prepared, writer.num_tool_calls())

    return await answer(request, streams, prepared.stream, writer, ended)
