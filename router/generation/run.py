"""Running a prepared request on the cluster: what every generating route shares (app.py's
completions and chat, router/endpoints/responses/serving.py) between a `Prepared` request and the
body it answers with.

1. `dispatch`: compile-check the request's constraint (one that does not compile never
   reaches a worker), count its chat features (tools, reasoning) in the metrics, wait
   (bounded) for a sleeping fleet, apply the key's cache salt,
   reserve the key's tokens (router/http/key_limits.py), start each prompt on the cluster; the
   merged stream counts what it generates into the key's ticket.
2. `settle`: wait on that stream (the whole of it, or its first update) only while the
   client stays: `ClientGone` when it leaves, a 502 when the workers failed before the first
   token; the stream is closed on any failure.
"""
from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request

from router.http.auth import effective_salt
from router.dispatch import Delta, WorkerFailed
from router.http.errors import APIError
from router.http.key_limits import TICKET, Ticket
from router.placement.placer import PromptKey
from router.placement.hint import PlacementHint
from router.services import Services
from router.http.streaming import merge, until_disconnect
from router.generation.prepare import Prepared

T = TypeVar("T")
Updates = AsyncIterator[tuple[int, Delta]]
"""(prompt index, delta) of every prompt of a request, as they come."""


async def dispatch(services: Services, request: Request, prepared: Prepared,
                   arrival: float) -> Updates:
    if prepared.constraint is not None:
        await services.grammars.check(prepared.constraint)
    _count_chat_features(services, prepared)
    await services.admin.wait_awake()  # a sleeping fleet: wait (bounded), then 503
    salt = effective_salt(request.scope, prepared.cache_salt)
    ticket = request.scope.get(TICKET)  # the key's tokens: reserved here, reconciled at the end
    services.key_limits.reserve(ticket, sum(map(len, prepared.prompts)),
                                completion_budget(prepared, services.max_model_len()))
    # Behind the endpoint picker, a one-prompt request may carry its placement.
    hint = (PlacementHint.from_headers(request.headers)
            if services.config.endpoint_picker.port and len(prepared.prompts) == 1 else None)
    streams = merge([
        services.dispatcher.generate(PromptKey(ids, salt, prepared.lora), prepared.sampling,
                                     arrival, prepared.priority, hint)
        for ids in prepared.prompts
    ])
    return streams if ticket is None else _counted(streams, ticket)


async def settle(request: Request, streams: Updates, work: Awaitable[T]) -> T:
    try:
        return await until_disconnect(request, work)
    except WorkerFailed as exc:
        await streams.aclose()
        raise APIError(502, str(exc), code="worker_failed") from None
    except BaseException:  # ClientGone included
        await streams.aclose()
        raise


async def collect(streams: Updates, add: Callable[[int, Delta], None]) -> None:
    """Every update of `streams`, into `add`."""
    async with aclosing(streams):
        async for prompt_idx, delta in streams:
            add(prompt_idx, delta)


def completion_budget(prepared: Prepared, max_model_len: int) -> int:
    """The most tokens a request may generate: max_tokens (else what the context leaves) x n,
    for each prompt."""
    sampling = prepared.sampling
    return sum(sampling.n * (sampling.max_tokens if sampling.max_tokens is not None
                             else max(0, max_model_len - len(ids)))
               for ids in prepared.prompts)


def _count_chat_features(services: Services, prepared: Prepared) -> None:
    output = prepared.output
    if output is None:
        return
    if output.tools:
        services.metrics.tool_requests.labels(output.tool_choice).inc()
    if output.reasoning is not None:
        services.metrics.reasoning_requests.inc()


def count_tool_calls(services: Services, prepared: Prepared, calls: int) -> None:
    """The tool calls a finished (or ended) response made, into the metrics."""
    if calls and prepared.output is not None:
        services.metrics.tool_calls.labels(prepared.output.tool_choice).inc(calls)


async def _counted(streams: Updates, ticket: Ticket) -> Updates:
    """`streams`, counting the tokens generated into the key's ticket."""
    async with aclosing(streams):
        async for item in streams:
            ticket.generated += len(item[1].token_ids)
            yield item

