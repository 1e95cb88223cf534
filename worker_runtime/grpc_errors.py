"""The one mapping from exceptions to gRPC status codes, applied to every servicer method of
a worker by one server interceptor (`StatusInterceptor`).

Only what a caller can fix maps to INVALID_ARGUMENT (a `ValueError`: validation). Anything
unexpected — a `TypeError` or `KeyError` from the engine is a bug, not bad input — is
INTERNAL and logged with its traceback."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """The worker cannot take this now (draining, or a dependency is down)."""


class ResourceExhausted(RuntimeError):
    """No room for the request now (e.g. KV pool full); retry elsewhere or later."""


class FailedPrecondition(RuntimeError):
    """The worker is not in a state that allows the call (e.g. sleep mode not enabled)."""


class PermissionDenied(RuntimeError):
    """The worker does not serve this call to anyone (e.g. an admin RPC not enabled)."""


class NotFound(LookupError):
    """What the call names does not exist (e.g. a LoRA adapter's path)."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    from engine.engine_loop import EngineLoopDied
    from engine.structured.fair_slots import CompileBusy
    from kvtransfer import IncompatiblePeerError, KVTransferError

    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, PermissionDenied):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, IncompatiblePeerError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, (KVTransferError, Unavailable, EngineLoopDied)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, (ResourceExhausted, CompileBusy)):  # no grammar compile slot in time
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


def _message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.strip("'\"") if isinstance(exc, KeyError) else text


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", method)
        details = f"internal error in {method}: {type(exc).__name__}: {_message(exc)}"
    else:
        details = _message(exc)
    await context.abort(code, details)


def _unary(behaviour: Callable[..., Awaitable[Any]], method: str):
    async def unary(request, context):
        try:
            return await behaviour(request, context)
        except Exception as exc:
            await _abort(context, exc, method)

    return unary


def _stream(behaviour: Callable[..., AsyncIterator[Any]], method: str):
    async def stream(request, context):
        try:
            async for item in behaviour(request, context):
                yield item
        except Exception as exc:
            await _abort(context, exc, method)

    return stream


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call whose servicer raised with the mapped status code and the exception's
    message (unary and server-streaming methods: all a worker has)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
