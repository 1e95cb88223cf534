"""The HTTP surface (FastAPI): OpenAI endpoints, /health, /metrics, /dashboard.

Every error leaves as an OpenAI error body. A request is prepared (validated, tokenized)
before any worker is involved; a streamed response starts only once its first update has
arrived, so placement failures (503) and workers failing before the first token (after the
retry, 502) are real HTTP statuses; a failure later ends the stream with an error event.
"""
from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.roles import Role
from router.endpoints.admin.serving import ADMIN_PATHS, add_admin_routes, dev_endpoints_enabled
from router.http.auth import authorize
from router.http.dashboard import add_dashboard_routes
from router.dispatch import Delta, WorkerFailed
from router.endpoints.embeddings.serving import add_embedding_routes
from router.http.errors import APIError
from router.endpoints.models.serving import add_info_routes
from router.generation.run import collect, count_tool_calls, dispatch, settle
from router.http.key_limits import LIMITED_PATHS, TENANT, TICKET
from router.http.limits import RequestLimits
from router.endpoints.loras.serving import add_lora_routes, runtime_updates_allowed
from router.http.openapi import GENERATE_ERRORS, install_openapi, route_schema
from router.endpoints.chat.protocol import ChatCompletionRequest
from router.endpoints.completions.protocol import CompletionRequest
from router.endpoints.chat.protocol import ChatCompletionResponse, ChatCompletionStreamChunk
from router.endpoints.completions.protocol import CompletionResponse, CompletionStreamChunk
from router.endpoints.models.protocol import HealthResponse
from router.generation.bodies import ChunkWriter, Collector, sse
from router.endpoints.responses.serving import add_responses_routes
from router.services import Services
from router.http.streaming import ClientGone
from router.generation.prepare import Kind, Prepared, prepare

log = logging.getLogger(__name__)

_ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
              "/health", "/metrics", "/tokenize", "/detokenize", "/version", "/v1/embeddings",
              "/dashboard", "/dashboard/data", "/v1/load_lora_adapter",
              "/v1/unload_lora_adapter", *ADMIN_PATHS}


def create_app(services: Services) -> FastAPI:
    app = FastAPI(title="pdserve router", lifespan=services.lifespan)
    app.add_middleware(RequestLimits, limits=services.config.limits)  # inside the next one
    app.add_middleware(_AuthAndCount, services=services)
    install_openapi(app)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)  # the detail stays here
        return APIError(500, "internal server error").response()

    @app.get("/health", response_model=None, responses={
        200: {"model": HealthResponse, "description": "A decode worker is usable"},
        503: {"model": HealthResponse, "description": "No decode worker is usable"}})
    async def health() -> Response:
        ready = {role: len(services.registry.ready(role)) for role in Role}
        ok = ready[Role.DECODE] > 0
        return JSONResponse({"status": "ok" if ok else "no_decode_workers",
                             "decode_workers": ready[Role.DECODE],
                             "prefill_workers": ready[Role.PREFILL]},
                            status_code=200 if ok else 503)

    @app.get("/metrics", response_model=None, responses={200: {
        "description": "Prometheus text format (the router's own registry)",
        "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        services.update_gauges()
        return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    add_info_routes(app, services)
    add_embedding_routes(app, services)
    add_dashboard_routes(app, services)
    add_responses_routes(app, services)
    add_lora_routes(app, services.loras, runtime_updates_allowed(services.config.enable_lora))
    if dev_endpoints_enabled(services.config.enable_dev_endpoints):
        add_admin_routes(app, services.admin)

    @app.post("/v1/completions", **route_schema(CompletionRequest, CompletionResponse,
                                                stream=CompletionStreamChunk,
                                                errors=GENERATE_ERRORS))
    async def completions(request: Request) -> Response:
        return await _generate(services, "completion", request)

    @app.post("/v1/chat/completions", **route_schema(ChatCompletionRequest, ChatCompletionResponse,
                                                     stream=ChatCompletionStreamChunk,
                                                     errors=GENERATE_ERRORS))
    async def chat_completions(request: Request) -> Response:
        return await _generate(services, "chat", request)

    return app


async def _generate(services: Services, kind: Kind, request: Request) -> Response:
    arrival = time.monotonic()
    body = await request.body()
    prepared = await services.tokenizing(len(body), prepare, kind, body, services.card,
                                         services.max_model_len(), services.loras.served(),
                                         services.config.limits)
    streams = await dispatch(services, request, prepared, arrival)
    # As vLLM: the client's X-Request-Id header, else the body's request_id, else a fresh one.
    base = request.headers.get("x-request-id") or prepared.request_id or uuid.uuid4().hex
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{base}"
    details = services.config.enable_prompt_tokens_details
    try:
        if not prepared.stream:
            collector = Collector(prepared, services.tokens, request_id, details)
            await settle(request, streams, collect(streams, collector.add))
            body = collector.response()
            count_tool_calls(services, prepared, collector.num_tool_calls())
            return JSONResponse(body)
        first = await settle(request, streams, anext(streams))
    except ClientGone:
        return Response(status_code=499)
    writer = ChunkWriter(prepared, services.tokens, request_id, details)
    return StreamingResponse(_sse(services, prepared, writer, first, streams),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse(services: Services, prepared: Prepared, writer: ChunkWriter,
               first: tuple[int, Delta],
               streams: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[bytes]:
    try:
        async with aclosing(_chunks(prepared, writer, first, streams)) as chunks:
            async for chunk in chunks:
                yield chunk
    finally:
        count_tool_calls(services, prepared, writer.num_tool_calls())


async def _chunks(prepared: Prepared, writer: ChunkWriter, first: tuple[int, Delta],
                  streams: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[bytes]:
    async with aclosing(streams):
        yield writer.opening() + writer.chunk(*first)
        try:
            async for prompt_idx, delta in streams:
                chunk = writer.chunk(prompt_idx, delta)
                if chunk:
                    yield chunk
        except (WorkerFailed, APIError) as exc:
            status = exc.status if isinstance(exc, APIError) else 502
            yield sse(APIError(status, str(exc), code="worker_failed").body())
            yield sse("[DONE]")
            return
    yield writer.closing()


class _AuthAndCount:
    """ASGI middleware: the key check (router/http/auth.py: which paths need which key), the
    per-key concurrency slot of a request to a worker path (router/http/key_limits.py: taken
    before the body is read, released once the response is over — a stream's end, the client
    gone, an error — which also reconciles the key's tokens), requests counted by endpoint
    and status (499: the client went away first), and every response carries an
    `X-Request-Id` header: the request's own, or a fresh one."""

    def __init__(self, app, services: Services) -> None:
        self.app = app
        self.services = services

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = (path if path in _ENDPOINTS
                    else "/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        status = {"code": 499}
        request_id = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"),
                          None) or uuid.uuid4().hex.encode()

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", request_id)]}
            await send(message)

        try:
            denied = authorize(self.services.keys, scope)
            if denied is not None:
                await denied.response()(scope, receive, counting_send)
                return
            limits = self.services.key_limits
            try:
                ticket = limits.admit(scope.get(TENANT)) if path in LIMITED_PATHS else None
            except APIError as refused:
                await refused.response()(scope, receive, counting_send)
                return
            scope[TICKET] = ticket
            try:
                await self.app(scope, receive, counting_send)
            finally:
                limits.release(ticket, served=status["code"] < 500)
        finally:
            self.services.metrics.requests.labels(endpoint, str(status["code"])).inc()
