"""POST /v1/responses: the route (its life cycle: router/endpoints/responses/__init__.py; the
collect-or-stream skeleton it shares: router/generation/run.py, `answer`)."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from router.config import LimitsConfig
from router.endpoints.chat.protocol import ChatCompletionRequest
from router.endpoints.responses.convert import (
    chat_body,
    input_messages,
    output_messages,
    renamed,
)
from router.endpoints.responses.objects import ResponsesResponse, ResponseStreamEvent
from router.endpoints.responses.protocol import ResponsesRequest, check, parse_request
from router.endpoints.responses.run import ResponseRun
from router.endpoints.responses.store import ResponseStore
from router.generation.model_card import ModelCard
from router.generation.prepare import Prepared, prepare_chat
from router.generation.run import answer, count_tool_calls, dispatch
from router.http.errors import APIError, bad_request, from_validation_errors
from router.http.key_limits import TENANT
from router.http.openapi import GENERATE_ERRORS, route_schema
from router.services import Services

STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"


def store_enabled(flag: bool) -> bool:
    """`--enable-response-store` on the router, or vLLM's switch in the environment."""
    return flag or os.environ.get(STORE_ENV, "") in ("1", "true", "True")


def add_responses_routes(app: FastAPI, services: Services) -> None:
    config = services.config
    store = (
        ResponseStore(config.response_store_max_entries, config.response_store_max_bytes)
        if store_enabled(config.enable_response_store)
        else None
    )

    @app.post(
        "/v1/responses",
        **route_schema(
            ResponsesRequest,
            ResponsesResponse,
            stream=ResponseStreamEvent,
            typed_events=True,
            errors=GENERATE_ERRORS,
        ),
    )
    async def create_response(request: Request) -> Response:
        return await _respond(services, store, request)


async def _respond(services: Services, store: ResponseStore | None, request: Request) -> Response:
    arrival = time.monotonic()
    body = await request.body()
    req = await services.tokenizing(len(body), parse_request, body)
    check(req)
    tenant = request.scope.get(TENANT)
    conversation = _history(store, tenant, req.previous_response_id) + input_messages(req.input)
    prepared = await services.tokenizing(
        len(body),
        _prepare,
        chat_body(req, conversation),
        services.card,
        services.max_model_len(),
        services.loras.served(),
        services.config.limits,
    )
    streams = await dispatch(services, request, prepared, arrival)
    keep = store is not None and req.store is not False
    run = ResponseRun(
        req,
        prepared,
        f"resp_{uuid.uuid4().hex}",
        keep,
        services.config.enable_prompt_tokens_details,
    )

    def finished(completed: bool) -> None:
        """The response ended (`completed`: not failed, nor left): its calls counted, it kept
        (before the client reads its end, so that it can continue it at once)."""
        count_tool_calls(services, prepared, run.parser.num_calls)
        if store is not None and keep and completed:
            store.put(tenant, run.id, conversation + output_messages(run.output()))

    return await answer(request, streams, prepared.stream, run, finished)


def _history(
    store: ResponseStore | None, tenant: bytes | None, previous_id: str | None
) -> list[dict[str, Any]]:
    """The conversation `previous_id` ended (none without one)."""
    if previous_id is None:
        return []
    if store is None:
        raise bad_request(
            "previous_response_id needs the router's response store (--enable-response-store)",
            "previous_response_id",
        )
    conversation = store.get(tenant, previous_id)
    if conversation is None:
        raise APIError(
            404, f"Response with id {previous_id!r} not found.", "previous_response_id", "not_found"
        )
    return conversation


def _prepare(
    chat: dict[str, Any],
    card: ModelCard,
    limit: int,
    adapters: Mapping[str, str],
    limits: LimitsConfig,
) -> Prepared:
    """The chat request prepared as /v1/chat/completions prepares it; a refusal names the
    Responses field."""
    try:
        req = ChatCompletionRequest.model_validate(chat)
        return prepare_chat(req, card, limit, adapters, limits)
    except ValidationError as exc:  # chat's own checks (e.g. a tool name's characters)
        raise renamed(from_validation_errors(exc.errors())) from None
    except APIError as exc:
        raise renamed(exc) from None
