"""Running a prepared request on the cluster: what every generating route shares (completions
and chat through router/generation/serve.py, router/endpoints/responses/serving.py) between a
`Prepared` request and the body it answers with.

1. `dispatch`: compile-check the request's constraint (one that does not compile never
   reaches a worker), count its chat features (tools, reasoning) in the metrics, wait
   (bounded) for a sleeping fleet, apply the key's cache salt,
   reserve the key's tokens (router/http/key_limits.py), start each prompt on the cluster; the
   merged stream counts what it generates into the key's ticket.
2. `settle`: wait on that stream (the whole of it, or its first update) only while the
   client stays: `ClientGone` when it leaves, a 502 when the workers failed before the first
   token (`worker_failed`: a fixed message naming the request id, the details in the log
   only); the stream is closed on any failure.
3. `answer`: the one collect-or-stream skeleton. Collected, the whole body is one JSON
   response; streamed, the response starts only once its first update has arrived (so
   placement failures, 503, and workers failing before the first token, 502, are real HTTP
   statuses) and a failure later ends the stream with the writer's error event. `ended` is
   called once, before the client reads the end (completed or not: failed, client gone).
"""

from __future__ import annotations

from contextlib import aclosing
from typing import (
    Any,
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Protocol,
    TypeVar,
    cast,
)

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from router.call import Delta, WorkerFailed
from router.generation.prepare import Prepared
from router.http.auth import effective_salt
from router.http.errors import REQUEST_ID, APIError, worker_failed
from router.http.key_limits import TENANT, TICKET, Ticket
from router.http.streaming import ClientGone, merge, until_disconnect
from router.placement.placer import PromptKey
from router.services import Services

T = TypeVar("T")
Updates = AsyncGenerator[tuple[int, Delta], None]
"""(prompt index, delta) of every prompt of a request, as they come."""


async def dispatch(
    services: Services, request: Request, prepared: Prepared, arrival: float
) -> Updates:
    if prepared.constraint is not None:
        # In the key's turn at the compile processes; the compile's seconds charged to it.
        await services.grammars.check(prepared.constraint, request.scope.get(TENANT))
    _count_chat_features(services, prepared)
    await services.admin.wait_awake()  # a sleeping fleet: wait (bounded), then 503
    salt = effective_salt(request.scope, prepared.cache_salt)
    ticket = request.scope.get(TICKET)  # the key's tokens: reserved here, reconciled at the end
    services.key_limits.reserve(
        ticket,
        sum(map(len, prepared.prompts)),
        completion_budget(prepared, services.max_model_len()),
    )
    # Behind the endpoint picker, a one-prompt request may carry its placement — sealed by
    # this router's picker; a hint a client wrote itself is ignored (and counted).
    hint = None
    if services.config.endpoint_picker.port and len(prepared.prompts) == 1:
        hint, refused = services.hint_seal.open(request.headers)
        if refused:
            services.metrics.placement_hints.labels("unsealed").inc()
    streams = merge(
        [
            services.dispatcher.generate(
                PromptKey(ids, salt, prepared.lora),
                prepared.sampling,
                arrival,
                prepared.priority,
                hint,
            )
            for ids in prepared.prompts
        ]
    )
    return streams if ticket is None else _counted(streams, ticket)


async def settle(request: Request, streams: Updates, work: Awaitable[T]) -> T:
    try:
        return await until_disconnect(request, work)
    except WorkerFailed as exc:
        await streams.aclose()
        raise worker_failed(request.scope.get(REQUEST_ID, "-"), exc) from None
    except BaseException:  # ClientGone included
        await streams.aclose()
        raise


class Collecting(Protocol):
    """A collected answer: every update in, then the whole body."""

    def add(self, prompt_idx: int, delta: Delta) -> None: ...

    def response(self) -> dict[str, Any]: ...


class Streaming(Protocol):
    """A streamed answer: each method returns the SSE bytes to send (maybe none)."""

    def opening(self) -> bytes: ...

    def chunk(self, prompt_idx: int, delta: Delta) -> bytes: ...

    def closing(self) -> bytes: ...

    def failed(self, exc: WorkerFailed | APIError) -> bytes: ...


async def answer(
    request: Request,
    streams: Updates,
    stream: bool,
    writer: Collecting | Streaming,
    ended: Callable[[bool], None],
) -> Response:
    """The response to `streams`: `stream` false, collected by `writer` (a `Collecting`),
    else streamed by it (a `Streaming`); 499 when the client left before it was ready."""
    try:
        if not stream:
            collecting = cast(Collecting, writer)
            await settle(request, streams, collect(streams, collecting.add))
            body = collecting.response()
            ended(True)
            return JSONResponse(body)
        first = await settle(request, streams, anext(streams))
    except ClientGone:
        return Response(status_code=499)
    return StreamingResponse(
        _events(cast(Streaming, writer), first, streams, ended, request.scope.get(REQUEST_ID, "-")),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(
    writer: Streaming,
    first: tuple[int, Delta],
    streams: Updates,
    ended: Callable[[bool], None],
    request_id: str,
) -> AsyncIterator[bytes]:
    done = False
    try:
        async with aclosing(streams):
            yield writer.opening() + writer.chunk(*first)
            try:
                async for prompt_idx, delta in streams:
                    chunk = writer.chunk(prompt_idx, delta)
                    if chunk:
                        yield chunk
            except (WorkerFailed, APIError) as exc:
                public = worker_failed(request_id, exc) if isinstance(exc, WorkerFailed) else exc
                tail, done = writer.failed(public), True
                ended(False)
                yield tail
                return
        tail, done = writer.closing(), True
        ended(True)
        yield tail
    finally:
        if not done:  # the client went away, or the stream was closed
            ended(False)


async def collect(streams: Updates, add: Callable[[int, Delta], None]) -> None:
    """Every update of `streams`, into `add`."""
    async with aclosing(streams):
        async for prompt_idx, delta in streams:
            add(prompt_idx, delta)


def completion_budget(prepared: Prepared, max_model_len: int) -> int:
    """The most tokens a request may generate: max_tokens (else what the context leaves) x n,
    for each prompt."""
    sampling = prepared.sampling
    return sum(
        sampling.n
        * (
            sampling.max_tokens
            if sampling.max_tokens is not None
            else max(0, max_model_len - len(ids))
        )
        for ids in prepared.prompts
    )


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
